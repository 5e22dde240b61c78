// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title NodeRegistry
/// @notice Permissionless registry binding an Ethereum account to a dlx-node's libp2p ed25519 public key
/// (the peer id derives from that key). One key per account and one account per key.
/// @dev The EVM has no ed25519 precompile, so the binding signature is not checked here: it is emitted in
/// `NodeRegistered` and verified off-chain by auditors (ledger/audit.py). The signed message is
/// "dlx-node/registry-binding/v1" || chainid (32 bytes, big-endian) || registry address (20) || account (20).
/// A registration whose signature does not verify is ignored by auditors; the minimum stake makes squatting a
/// key with a bad signature cost money (see docs/LEDGER.md).
contract NodeRegistry {
    /// @dev Length in bytes of an ed25519 signature.
    uint256 private constant _SIGNATURE_LENGTH = 64;

    uint256 private immutable _minStake;
    mapping(address account => bytes32 pubkey) private _keyOf;
    mapping(bytes32 pubkey => address account) private _accountOf;
    mapping(address account => uint256 stake) private _stakeOf;
    uint256 private _nodeCount;

    /// @notice `account` bound itself to the ed25519 key `pubkey`, depositing `stake` wei.
    event NodeRegistered(address indexed account, bytes32 indexed pubkey, bytes signature, uint256 stake);
    /// @notice `account` left the registry; its key is free again and `stake` wei were returned.
    event NodeUnregistered(address indexed account, bytes32 indexed pubkey, uint256 stake);

    error RegistryAlreadyRegistered(address account, bytes32 pubkey);
    error RegistryKeyTaken(bytes32 pubkey, address holder);
    error RegistryZeroKey();
    error RegistryBadSignatureLength(uint256 length);
    error RegistryStakeTooLow(uint256 required, uint256 sent);
    error RegistryNotRegistered(address account);
    error RegistryRefundFailed(address account, uint256 amount);

    /// @param minStake_ Wei a node must send with `register`; 0 makes registration free.
    constructor(uint256 minStake_) {
        _minStake = minStake_;
    }

    /// @notice Bind the caller's account to the node key `pubkey`.
    /// @param pubkey The node's raw 32-byte ed25519 public key.
    /// @param signature The key's 64-byte ed25519 signature over the binding message (see contract doc).
    /// @dev Payable: `msg.value` must be at least the minimum stake and is held until `unregister`.
    function register(bytes32 pubkey, bytes calldata signature) external payable {
        if (pubkey == bytes32(0)) revert RegistryZeroKey();
        if (signature.length != _SIGNATURE_LENGTH) revert RegistryBadSignatureLength(signature.length);
        if (msg.value < _minStake) revert RegistryStakeTooLow(_minStake, msg.value);
        bytes32 held = _keyOf[msg.sender];
        if (held != bytes32(0)) revert RegistryAlreadyRegistered(msg.sender, held);
        address holder = _accountOf[pubkey];
        if (holder != address(0)) revert RegistryKeyTaken(pubkey, holder);

        _keyOf[msg.sender] = pubkey;
        _accountOf[pubkey] = msg.sender;
        _stakeOf[msg.sender] = msg.value;
        _nodeCount += 1;
        emit NodeRegistered(msg.sender, pubkey, signature, msg.value);
    }

    /// @notice Leave the registry: frees the caller's key and returns its stake.
    function unregister() external {
        bytes32 pubkey = _keyOf[msg.sender];
        if (pubkey == bytes32(0)) revert RegistryNotRegistered(msg.sender);
        uint256 stake = _stakeOf[msg.sender];

        // Effects before the refund call, so a re-entrant call finds the account already gone.
        delete _keyOf[msg.sender];
        delete _accountOf[pubkey];
        delete _stakeOf[msg.sender];
        _nodeCount -= 1;
        emit NodeUnregistered(msg.sender, pubkey, stake);

        if (stake > 0) {
            (bool ok,) = payable(msg.sender).call{value: stake}("");
            if (!ok) revert RegistryRefundFailed(msg.sender, stake);
        }
    }

    /// @notice Whether `account` is currently registered.
    /// @param account The Ethereum account to look up.
    /// @return True if `account` holds a node key.
    function isRegistered(address account) external view returns (bool) {
        return _keyOf[account] != bytes32(0);
    }

    /// @notice The node key bound to `account`.
    /// @param account The Ethereum account to look up.
    /// @return The 32-byte ed25519 public key, or zero if `account` is not registered.
    function keyOf(address account) external view returns (bytes32) {
        return _keyOf[account];
    }

    /// @notice The account bound to the node key `pubkey`.
    /// @param pubkey The 32-byte ed25519 public key to look up.
    /// @return The account, or the zero address if the key is not registered.
    function accountOf(bytes32 pubkey) external view returns (address) {
        return _accountOf[pubkey];
    }

    /// @notice The stake `account` deposited when it registered.
    /// @param account The Ethereum account to look up.
    /// @return The stake in wei (0 if unregistered).
    function stakeOf(address account) external view returns (uint256) {
        return _stakeOf[account];
    }

    /// @notice The minimum stake `register` requires.
    /// @return The stake in wei.
    function minStake() external view returns (uint256) {
        return _minStake;
    }

    /// @notice The number of currently registered nodes.
    /// @return The count.
    function nodeCount() external view returns (uint256) {
        return _nodeCount;
    }
}
