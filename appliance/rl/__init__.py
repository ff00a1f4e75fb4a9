"""Post-training from execution feedback: its shared records and the life of its runs and exports.
The CLI, the admin API and the TUI read these records; finetune.rl does the work.

- tasks: programming tasks and the task-set index
- attempts: one executed answer to a task (a line of a trajectory)
- runs: the RL run queue and a run's directory
- progress: a run's live figures
- exports: the queue of datasets asked of finished runs
"""
