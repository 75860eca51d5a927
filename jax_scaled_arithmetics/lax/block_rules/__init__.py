"""Rules that keep block scales (one scale per row, channel, MX block, tile or layer).

A primitive with a rule here keeps its operands' block layouts; any other primitive gets its
block-scaled operands in per-tensor form (the largest block scale, every block's data
multiplied by its ratio to it: `core.block_scales.to_per_tensor`) and its ordinary rule.
Layouts meet at their common refinement (along each axis, blocks of the greatest common
divisor of the operands' block sizes), so operands with different layouts combine
exactly. Outputs of sums and contractions get one dynamic power-of-two scale per block
(the largest finite magnitude of each block), whatever the policy.

One module a family of primitives:

- `shape`: data-only ops, shape ops, rev and concatenate;
- `elementwise`: mul, div, add, sub, max, min, select_n and non-linear functions;
- `contractions`: reductions, dot_general and convolutions;
- `indexing`: gather, dynamic slices, pad and scatters;
- `reblocking`: bringing values to one layout (control-flow carries, cond branches).

Importing this package registers every rule.
"""

from . import contractions as contractions
from . import elementwise as elementwise
from . import indexing as indexing
from . import reblocking as reblocking
from . import shape as shape
from .reblocking import meet_scale_shapes as meet_scale_shapes
from .reblocking import to_scale_shape as to_scale_shape

__all__ = ["meet_scale_shapes", "to_scale_shape"]
