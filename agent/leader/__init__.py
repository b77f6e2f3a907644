"""The leader: its decisions (pure), the duty that writes them, and the election."""
