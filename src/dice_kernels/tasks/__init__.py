"""KernelBench-format tasks: loading from files, KernelBench-layout directories and JSONL, plus task hygiene."""

from dice_kernels.tasks.loader import Task, TaskError, load_task_file, load_tasks, task_from_code

__all__ = ["Task", "TaskError", "load_task_file", "load_tasks", "task_from_code"]
