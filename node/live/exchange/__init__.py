"""How a round's contributions travel between the holders of a stage and which ones a round closes on: the
protocol, one module per kind (full, sliced), the close (coordination) and its takeover."""
