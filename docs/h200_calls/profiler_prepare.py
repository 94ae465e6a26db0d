import sys, time
t0 = time.perf_counter()
import torch
from torch.profiler import ProfilerActivity, profile
acts = {"both": [ProfilerActivity.CPU, ProfilerActivity.CUDA], "cuda": [ProfilerActivity.CUDA],
        "cpu": [ProfilerActivity.CPU]}[sys.argv[1]]
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t = time.perf_counter(); c = time.process_time()
p = profile(activities=acts); p.prepare_trace()
print(sys.argv[1], "prepare wall %.3f cpu %.3f" % (time.perf_counter() - t, time.process_time() - c), flush=True)
t = time.perf_counter(); p.start_trace(); p.stop_trace(); print("start+stop %.3f" % (time.perf_counter() - t))
