"""The trust fuzzer's cast and parameters, shared by tests/trust_machine.py and tests/trust_sums.py."""

from __future__ import annotations

import hashlib

from ledger import errors

STAKE = 10**15
BOND = 10**14
HONEST = (1, 2, 3, 4)  # founders
COALITION = (5, 6)  # founders
HONEST_JOINER = 7
COALITION_JOINER = 8
OUTSIDER = 9  # proves and challenges: no member, no stake
#: The stake of the coalition's captured runs (tests/trust_sums.py), 0.1 ETH: half of its two seats' is the
#: walker's reward, which must cover the walk's gas (1.1e15 wei on py-evm for a walk of four steps and its
#: proof) and bonds (tests/trust_game.py, G2).
CAPTURED_STAKE = 10**17
#: A captured run's proof fund, deposited by its creator (issue 79): a proof's reward is min(fund, half the
#: slash), paid from it; the slash itself is burned whole.
CAPTURED_FUND = len(COALITION) * CAPTURED_STAKE
#: The reward of a walk that overturns a captured round: min(the fund, half the slash of its two attesters).
CAPTURED_REWARD = min(CAPTURED_FUND, len(COALITION) * CAPTURED_STAKE // 2)
WINDOW = 8  # accusation and dispute windows, in blocks
INACTIVITY = 2
TENURE = 2
#: Every revert a hostile or mistimed action may meet: the contract refusing it is the point.
REFUSED = errors.ContractRevert


def digest(label: str) -> bytes:
    """sha256 of a label: a stand-in hash."""
    return hashlib.sha256(label.encode()).digest()
