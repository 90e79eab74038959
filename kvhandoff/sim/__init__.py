"""A calibrated discrete-event model of a disaggregated fleet (`kvhandoff simulate`): costs fitted from a
`kvhandoff bench` run (calibrate.py), a fleet of any size stepped through them (fleet.py), the command
(command.py). It reads bench results only, never the engine."""
