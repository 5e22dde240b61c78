"""The round machinery: when a round closes, who it waits for, how it is finished, entered, resumed and paced,
and what the node keeps per round."""
