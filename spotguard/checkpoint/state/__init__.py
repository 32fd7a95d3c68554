"""What a training state is, and how it is held in host memory before it is written.

``state`` collects the tracked objects' state dicts and every RNG stream; ``data`` and ``workers`` make a
resumed data loader continue exactly (another worker count or batch size checked); ``loadable`` checks on
the first save that the state will load with ``weights_only``; ``snapshot``, ``slabs`` and ``budget`` copy
it into reused (pinned) buffers, allocated off the loop's thread, within a host-memory budget; ``upload``
moves a verified checkpoint's GPU-bound tensors there through pinned buffers on resume (from the local
file the engine verified). Nothing here knows about storage: both engines and the trainer integrations
use it.
"""
