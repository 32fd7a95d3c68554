"""spotguard for the trainers people already use: Hugging Face Trainer, Accelerate, Lightning.

One module per trainer, each imported only by name (``spotguard.integrations.hf``,
``.accelerate``, ``.lightning``), so that installing spotguard never pulls in a trainer: the
trainers come with the extras ``spotguard[hf]`` and ``spotguard[lightning]``. They share
``_common`` (a notice watch over spotguard's ``Watcher``), ``_folders`` (the trainer's own checkpoint
folders committed to spotguard storage with a manifest written last, so a folder cut short is never
resumed), and ``_group`` (the rank vote); the heartbeat's ``Activity`` marks what ``spotguard rehearse`` times.
"""
