"""The factories that build a node's parts from its base and from each other, one module per concern;
assembly.py calls them in dependency order."""
