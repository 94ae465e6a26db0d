"""`dice bench`: a checkpoint (or a folder of any model's generations) to the DICE paper's KernelBench table. It owns
the run folder (generations written as they finish, resumable), batched generation across tasks and the hand-off to
the harness; tables and plots are report/bench_report.py's."""
