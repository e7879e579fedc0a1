"""The node agent (`python -m proxy [flags]`): app.py wires it up and says how it starts
and stops, sync_loop.py is the sync loop, schedule.py its timing, main.py the process."""
