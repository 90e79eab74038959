"""`kvhandoff up`: the one-machine supervisor (supervisor.py) that starts, watches and restarts a
fleet's processes, the emulated links between its hosts (netlink.py), and the lifeline that ends a
child with its parent (lifeline.py)."""
