"""Which tasks this node claims, and when.

The claim round (``claimer.py``) asks the pure rules — fit (``choose.py``), locality
(``placement.py``), pool preference (``pool_preference.py``) — what to take, with their I/O
beside them (``locality.py``, ``pool_wait.py``, ``wake_timer.py``), and reads back claims
whose transaction's answer was lost (``unsure.py``).
"""
