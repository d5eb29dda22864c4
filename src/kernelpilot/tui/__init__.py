"""The terminal UI: watch an agent run live (transcript, plan, latest edit, profiles) and steer it; then, or with
`kernelpilot watch DIR --tui` alone, judge every save of the workspace (`watching.py`).

`app.py` holds the Textual app and `run_tui`; each panel has its own file; `control.py` is the thread-safe
pause/stop switch and session tap between the agent's worker thread and the UI. Textual is imported only here
in the submodules, never by the CLI at startup.
"""
