"""A worker's tensor-parallel group: its rank, size and communicator (:mod:`.group`: MPI, or
:mod:`.torch_group`'s ``torch.distributed``), and which source heads fill which target heads (:mod:`.head_slices`).

May import: the core's ``errors``, ``log``, ``protocol``. Never a part.
"""
