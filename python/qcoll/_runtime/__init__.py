"""The call runtime: everything between an API function and the core, in one place.

A call's path (quantized_allgather, quantized_reduce_scatter, quantized_all_reduce,
delta_allgather; the FSDP2 / DDP / ZeRO plug-ins call those):

  API module      parses its keywords into a policy (qcoll.policy) and composes the call's
                  steps; nothing else
  args.py         checks the tensors, the op and the group size once, on every rank, before
                  any communication
  steps.py        plans each step in the core (cached per signature) and runs it: the
                  core's all-gather / reduce-scatter / transport all-reduce with the call's
                  CallContext and, per core call, a CallBuffers (buffers.py) that the core
                  hands back to the torch transport (_torch_transport.py) with each exchange
  call.py         gives the call its number, context and workspace and runs it: on the
                  family's worker for CPU tensors (worker.py: CallQueue, Work), on the
                  family's communication stream for CUDA tensors (streams.py: CudaCalls)
  core (_C)       validates the plan, checks that the ranks agree, encodes, exchanges
                  through the Communicator (NCCL, or the torch transport), decodes

Only this package reads a Group's private state (its worker, streams, call numbers,
workspace, communicators' accounting): see call.py's functions for the plug-ins."""
