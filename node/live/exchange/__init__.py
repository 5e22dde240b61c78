"""How a round's contributions travel between the holders of a stage: the exchange protocol and one module per kind (full, sliced)."""
