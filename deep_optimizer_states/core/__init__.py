"""The optimizer's machinery: host layout, pinned memory, the update engine and its lanes, AdamW math,
global-norm and loss scaling, state_dict I/O, placements, and what a rank shares (FSDP2)."""
