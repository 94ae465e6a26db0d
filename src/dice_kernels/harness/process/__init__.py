"""The harness's processes, parent side and the pipes between them: the pool of sandboxed workers (pool.py), the
fork server they are forked from, the sandbox that confines and supervises them, the typed jobs they get
(protocol.py), the output frames they stream back (tensor_stream.py), the device lock, and host-memory admission
of reference outputs (host_memory.py, input_size.py)."""
