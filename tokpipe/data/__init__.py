"""From a finished OUT to training batches: `from tokpipe.data import Permutation, Sequences, Mixture`.

numpy only (torch.from_numpy turns a batch into tensors without a copy). Reads OUT through its contract
(tokpipe.layout: meta) and the one reader of a split's files (tokpipe.read.files), and never writes it.
"""

from tokpipe.data.mixture import Mixture
from tokpipe.data.permutation import Permutation
from tokpipe.data.sequences import Batch, Sequences

__all__ = ["Permutation", "Sequences", "Mixture", "Batch"]
