"""Full-graph sparse products beyond one GPU: a square CSR matrix and its dense operands split by
rows over the ranks of a ``torch.distributed`` process group (gloo on the CPU, NCCL on GPUs).

Pipeline stage 11 of 14 (beside :mod:`torch_sparserl.compiler` and
:mod:`torch_sparserl.integrations`): every rank's blocks are :class:`~torch_sparserl.CSRMatrix`
objects, so each product goes through the library's operators and JIT.
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit,
ops, tensor.

::

    import torch_sparserl as ts
    D = ts.distributed.distribute_csr(A, order="rcm")   # every rank, the same A
    D = ts.distributed.DistributedCSRMatrix.from_local(my_rows, part)   # or each rank its rows
    Y_local = D @ D.shard_rows(X)                        # this rank's rows of A @ X

=====================  =====================================================================
module                 what it holds
=====================  =====================================================================
:mod:`.partition`      :class:`Partition` (pure data) and :func:`partition`: the row orders
:mod:`.halo`           a rank's local and halo blocks, the exchange plan, the P2P exchange
:mod:`.matrix`         :class:`DistributedCSRMatrix` (``.from_local``: a rank's rows alone), :func:`distribute_csr`
=====================  =====================================================================
"""

from .halo import Block, HaloExchangeError, HaloPlan, receives, sends_from, split_block
from .matrix import DistributedCSRMatrix, distribute_csr
from .partition import BALANCES, ORDERS, Partition, partition

__all__ = ["BALANCES", "Block", "DistributedCSRMatrix", "HaloExchangeError", "HaloPlan", "ORDERS", "Partition",
           "distribute_csr", "partition", "receives", "sends_from", "split_block"]
