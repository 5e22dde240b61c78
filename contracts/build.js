#!/usr/bin/env node
// Reproducible build of the dlx-node contracts with the pinned solc (package.json) through its
// standard-JSON JS API (the `solcjs --standard-json` CLI prints a line before the JSON; the API does not).
//
//   node contracts/build.js          write contracts/build/input.json and contracts/artifacts/<Name>.json
//   node contracts/build.js --check  rebuild in memory; exit 1 if any committed file differs
//   node contracts/build.js --sizes  rebuild in memory; print each artifact's deployed size (EIP-170 share)
//
// Either way the build fails (exit 1) if any deployed contract or library passes 90% of EIP-170's 24,576 bytes.
//
// The Python client loads only the committed artifacts, so running a node needs no Node.js.
"use strict";

const fs = require("fs");
const path = require("path");
const solc = require("solc");

const ROOT = __dirname;
const SOURCES = [
  "src/NodeRegistry.sol", "src/TrainingLedger.sol", "src/LedgerCore.sol", "src/LedgerMembership.sol",
  "src/LedgerDisputes.sol", "src/LedgerAccusations.sol", "src/AggregationProver.sol", "src/ProverCommon.sol",
  "src/ProverChunks.sol", "src/ProverNorms.sol", "src/ProverAvailability.sol", "src/ProverBinding.sol",
  "src/Float32.sol",
  "src/Float32General.sol", "src/NormRule.sol",
  "src/test/Float32Harness.sol", "src/test/NormHarness.sol", "src/test/AnswerRelay.sol",
  "src/StepProver.sol", "src/StepProverMath.sol", "src/Float64Functions.sol", "src/StepProverBinding.sol",
  "src/RewardPool.sol", "src/test/ReentrantClaimer.sol", "src/test/QuirkyToken.sol",
];
// Every deployed contract and linked library (an artifact each; contracts/__init__.py NAMES lists them too).
const CONTRACTS = {
  "src/NodeRegistry.sol": "NodeRegistry",
  "src/TrainingLedger.sol": "TrainingLedger",
  "src/LedgerMembership.sol": "LedgerMembership",
  "src/LedgerDisputes.sol": "LedgerDisputes",
  "src/LedgerAccusations.sol": "LedgerAccusations",
  "src/AggregationProver.sol": "AggregationProver",
  "src/ProverChunks.sol": "ProverChunks",
  "src/ProverNorms.sol": "ProverNorms",
  "src/ProverAvailability.sol": "ProverAvailability",
  "src/ProverBinding.sol": "ProverBinding",
  "src/StepProver.sol": "StepProver",
  "src/StepProverMath.sol": "StepProverMath",
  "src/Float64Functions.sol": "Float64Functions",
  "src/StepProverBinding.sol": "StepProverBinding",
  "src/test/Float32Harness.sol": "Float32Harness",
  "src/test/NormHarness.sol": "NormHarness",
  "src/test/AnswerRelay.sol": "AnswerRelay",
  "src/RewardPool.sol": "RewardPool",
  "src/test/ReentrantClaimer.sol": "ReentrantClaimer",
  "src/test/QuirkyToken.sol": "QuirkyToken",
};
const EXPECTED_COMPILER = "0.8.37";
// EIP-170: the most bytes of code a contract may deploy. The build fails past SIZE_GATE of it (room for the next
// change to notice before the chain refuses the deployment); tests/test_contracts_build.py holds the committed
// artifacts to SIZE_TARGET (75%).
const CODE_SIZE_LIMIT = 24576;
const SIZE_GATE = Math.floor(CODE_SIZE_LIMIT * 0.9); // 22,118 bytes


function standardInput() {
  const sources = {};
  for (const name of SOURCES) {
    sources[name] = { content: fs.readFileSync(path.join(ROOT, name), "utf8") };
  }
  return {
    language: "Solidity",
    sources,
    settings: {
      evmVersion: "prague",
      optimizer: { enabled: true, runs: 200 },
      viaIR: false,
      metadata: { bytecodeHash: "ipfs", appendCBOR: true, useLiteralContent: false },
      outputSelection: {
        "*": {
          "*": [
            "abi",
            "metadata",
            "evm.bytecode.object",
            "evm.bytecode.linkReferences",
            "evm.deployedBytecode.object",
            "evm.deployedBytecode.immutableReferences",
            "evm.deployedBytecode.linkReferences",
            "evm.methodIdentifiers",
          ],
        },
      },
    },
  };
}

function render(value) {
  return JSON.stringify(value, null, 2) + "\n";
}

function build() {
  const version = solc.version();
  if (!version.startsWith(EXPECTED_COMPILER + "+")) {
    throw new Error(`solc ${version} found, ${EXPECTED_COMPILER} pinned: run npm ci --prefix contracts`);
  }
  const input = standardInput();
  const output = JSON.parse(solc.compile(JSON.stringify(input)));
  const problems = (output.errors || []).filter((e) => e.severity === "error");
  const warnings = (output.errors || []).filter((e) => e.severity !== "error");
  for (const w of warnings) process.stderr.write(w.formattedMessage + "\n");
  if (problems.length > 0) {
    throw new Error("compilation failed:\n" + problems.map((e) => e.formattedMessage).join("\n"));
  }
  const files = { "build/input.json": render(input) };
  const oversized = [];
  for (const [source, name] of Object.entries(CONTRACTS)) {
    const contract = output.contracts[source][name];
    const size = contract.evm.deployedBytecode.object.length / 2;
    if (size > SIZE_GATE) oversized.push(`${name} (${source}): ${size} bytes deployed`);
    files[`artifacts/${name}.json`] = render({
      contractName: name,
      sourceName: source,
      compiler: version,
      settings: { evmVersion: input.settings.evmVersion, optimizer: input.settings.optimizer },
      abi: contract.abi,
      bytecode: "0x" + contract.evm.bytecode.object,
      deployedBytecode: "0x" + contract.evm.deployedBytecode.object,
      immutableReferences: contract.evm.deployedBytecode.immutableReferences || {},
      // Libraries to link (source -> name -> byte ranges holding its address): contracts/__init__.py link().
      linkReferences: contract.evm.bytecode.linkReferences || {},
      deployedLinkReferences: contract.evm.deployedBytecode.linkReferences || {},
      methodIdentifiers: contract.evm.methodIdentifiers,
      metadata: contract.metadata,
    });
  }
  if (oversized.length > 0) {
    throw new Error(
      `deployed code past 90% of the EIP-170 limit (${SIZE_GATE} of ${CODE_SIZE_LIMIT} bytes): ` +
        oversized.join("; ") + ". Split the contract (move a concern into a linked library: docs/LEDGER.md)"
    );
  }
  return files;
}

/// Deployed bytes of every artifact, and their share of the EIP-170 limit (node contracts/build.js --sizes).
function sizes(files) {
  const lines = [];
  for (const [relative, content] of Object.entries(files)) {
    if (!relative.startsWith("artifacts/")) continue;
    const artifact = JSON.parse(content);
    const deployed = (artifact.deployedBytecode.length - 2) / 2;
    const initcode = (artifact.bytecode.length - 2) / 2;
    const share = ((100 * deployed) / CODE_SIZE_LIMIT).toFixed(1);
    lines.push(`${artifact.contractName.padEnd(20)} ${String(deployed).padStart(6)} bytes deployed ` +
      `(${share.padStart(4)}% of ${CODE_SIZE_LIMIT}), initcode ${initcode}`);
  }
  return lines.join("\n") + "\n";
}

function main() {
  const check = process.argv.includes("--check");
  let files;
  try {
    files = build();
  } catch (error) {
    process.stderr.write(`build.js: ${error.message}\n`);
    process.exit(1);
  }
  if (process.argv.includes("--sizes")) {
    process.stdout.write(sizes(files));
    return;
  }
  let stale = [];
  for (const [relative, content] of Object.entries(files)) {
    const target = path.join(ROOT, relative);
    if (check) {
      const committed = fs.existsSync(target) ? fs.readFileSync(target, "utf8") : null;
      if (committed !== content) stale.push(relative);
    } else {
      fs.mkdirSync(path.dirname(target), { recursive: true });
      const temporary = target + ".tmp";
      fs.writeFileSync(temporary, content);
      fs.renameSync(temporary, target);
      process.stdout.write(`wrote contracts/${relative}\n`);
    }
  }
  if (check) {
    if (stale.length > 0) {
      process.stderr.write(`rebuild differs from the committed files: ${stale.join(", ")}\n`);
      process.stderr.write("run `node contracts/build.js` and commit the result\n");
      process.exit(1);
    }
    process.stdout.write(`contracts up to date (${Object.keys(files).length} files, solc ${solc.version()})\n`);
  }
}

main();
