"""What a checkpoint is on disk, and how a reader finds and checks one: the floor everything else stands on.

``manifest`` names the ``step-N/`` folders and defines the manifest (the commit marker, written last);
``bounds`` keeps its numbers sane; ``digest`` is the chunked checksum of every file; ``reader`` scans a
storage, picks the latest checkpoint and hands out a file only after its size and checksum matched.
These modules import nothing else of ``checkpoint`` and no torch, so ``spotguard ls``/``verify`` and every
writer share one definition of the format.
"""
