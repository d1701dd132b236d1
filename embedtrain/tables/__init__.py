"""Dynamic embedding tables: raw ids remapped collision-free by TorchRec's managed-collision
modules, with admission, eviction (``policies``) and per-table counters (``dynamic``), the remap
of a collection's tables together (``fused``: sorted arrays in ``sorted``, the id mix in
``ids``). Import from the modules (this package exports nothing).
"""
