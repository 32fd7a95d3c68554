"""One checkpoint file, written once: from a state to bytes in a storage, hashed as they pass.

``serialize`` is ``torch.save`` without the zip's CRC32; ``stream`` feeds a state's tensor bytes to the file
in a pipeline, from the device or host memory; ``fileio`` writes past the page cache (``O_DIRECT``) and
hashes on a helper thread; ``filewrite`` stores the result (a hard link locally, an upload or a streamed
upload to a bucket). Every writer of a checkpoint file (the single engine, the sharded one's DCP shards
and rank files) goes through here; it knows files, not folders or manifests' commit order.
"""
