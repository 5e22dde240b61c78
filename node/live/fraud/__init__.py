"""The fraud proof in a running node: a chunked run's stage states, proving a wrong round on chain, answering
availability challenges."""
