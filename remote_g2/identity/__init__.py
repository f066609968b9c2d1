"""What makes two blocks the same: block hashes (:mod:`.hashing`, vLLM's in :mod:`.vllm_hashing`)
and the model identity in every layout fingerprint (:mod:`.model_identity`: the digest of the loaded weights,
:mod:`.file_digest`, with :mod:`.load_snapshot` and :mod:`.mounts` proving the bytes did not change).

May import: the core's ``errors``, ``log``, ``config``. Never :mod:`remote_g2.rpc` or a part.
"""
