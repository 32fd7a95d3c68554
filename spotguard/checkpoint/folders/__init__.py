"""Checkpoint folders in a storage root: how one is committed, copied, pruned, deleted and cleaned up.

``layout`` writes a ``step-N/`` folder (files first, manifest last) and copies one between tiers;
``folders`` commits a trainer's own folder written by several ranks or nodes the same way, and ``pernode``
says which of its files one node fetches to resume; ``retention`` prunes the oldest and deletes one
(manifest first); ``stale_local`` drops local copies a final save made stale; ``cleanup`` decides what
``spotguard rm --incomplete`` may delete. Built on ``format`` and ``files``; the engines and integrations
call it.
"""
