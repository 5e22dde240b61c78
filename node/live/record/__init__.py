"""The round's record: signing it, gathering a quorum, committing and verifying it, the checkpoint it names,
healing a fork."""
