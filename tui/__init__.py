"""The Textual admin app (`tui.app.AdminApp`, run by `appliance tui`); it talks to the running
appliance through its REST admin API only. Nothing is imported here, so the CLI stays quick."""
