#!/usr/bin/env node
// Reproducible build of the dlx-node contracts with the pinned solc (package.json) through its
// standard-JSON JS API (the `solcjs --standard-json` CLI prints a line before the JSON; the API does not).
//
//   node contracts/build.js          write contracts/build/input.json and contracts/artifacts/<Name>.json
//   node contracts/build.js --check  rebuild in memory; exit 1 if any committed file differs
//
// The Python client loads only the committed artifacts, so running a node needs no Node.js.
"use strict";

const fs = require("fs");
const path = require("path");
const solc = require("solc");

const ROOT = __dirname;
const SOURCES = [
  "src/NodeRegistry.sol", "src/TrainingLedger.sol", "src/AggregationProver.sol", "src/Float32.sol",
  "src/Float32General.sol", "src/NormRule.sol",
  "src/test/Float32Harness.sol", "src/test/NormHarness.sol",
];
const CONTRACTS = {
  "src/NodeRegistry.sol": "NodeRegistry",
  "src/TrainingLedger.sol": "TrainingLedger",
  "src/AggregationProver.sol": "AggregationProver",
  "src/test/Float32Harness.sol": "Float32Harness",
  "src/test/NormHarness.sol": "NormHarness",
};
const EXPECTED_COMPILER = "0.8.37";

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
            "evm.deployedBytecode.object",
            "evm.deployedBytecode.immutableReferences",
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
  for (const [source, name] of Object.entries(CONTRACTS)) {
    const contract = output.contracts[source][name];
    files[`artifacts/${name}.json`] = render({
      contractName: name,
      sourceName: source,
      compiler: version,
      settings: { evmVersion: input.settings.evmVersion, optimizer: input.settings.optimizer },
      abi: contract.abi,
      bytecode: "0x" + contract.evm.bytecode.object,
      deployedBytecode: "0x" + contract.evm.deployedBytecode.object,
      immutableReferences: contract.evm.deployedBytecode.immutableReferences || {},
      methodIdentifiers: contract.evm.methodIdentifiers,
      metadata: contract.metadata,
    });
  }
  return files;
}

function main() {
  const check = process.argv.includes("--check");
  const files = build();
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
