"""The node agent (`python -m proxy [flags]`): main.py the process, app.py how it starts
and stops, sync_loop.py the sync loop and schedule.py its timing, worker.py the data-plane
thread, changes.py the pending changes, logs.py the log formats, startup_gc.py the
collector paused while the cluster loads."""
