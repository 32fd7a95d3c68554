"""The sharded engine: checkpoints written and resumed by every rank of a process group together.

``sharded`` saves (DCP shards for model and optimizer, one small file per rank, the manifest last after
every rank reported); ``sharded_async`` writes them in the background, the ranks coordinated through the
job's store; ``sharded_load`` resumes, the ranks agreeing on every failure; ``dcp`` and ``item_io`` put
torch.distributed.checkpoint on spotguard's storage and read its items straight into their targets.
Everything here imports torch.distributed, so ``checkpoint.make_engine`` loads it only for a process group.
"""
