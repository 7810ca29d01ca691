"""The low-precision gate: does a low-precision path really pay?

``int8attn gate`` (see :mod:`int8attn.cli`) and :func:`run_gate` run experiments that
each compare low-precision paths with their BF16 counterpart on the same inputs, report
seven items per path (bytes, bandwidth, where quantization happens, scale reuse, the matrix
instruction in the SASS, accuracy, eager vs CUDA graph) and end with an adopt/reject verdict:

* E1 -- dynamic INT8 GEMM vs cuBLAS BF16 (the second article's negative result);
* E2 -- FP8 KV paged decode vs BF16 (plugs in with the decode kernel);
* E3 -- QK alone: INT8 K -> BF16 dot vs native INT8 dot vs BF16 (the first article's table);
* E4 -- our INT8 decode/prefill vs their BF16-cache counterparts (plugs in with them).

Without a GPU the gate runs tiny sizes under the Triton interpreter, marks every timing
meaningless and skips SASS, and still writes report.md / report.json / plots.

The orchestration is :mod:`int8attn.gate.command`; this package only exports its public names.
"""

from . import registry
from .command import SIZES, load_tensors, run_gate

__all__ = ["run_gate", "load_tensors", "registry", "SIZES"]
