"""What the tests share; a test module imports from here, never from another test module.

dist_utils     the gloo World: N rank processes kept for many tests, ``world.run(fn, ...)``
               (``fn`` a module-level function the ranks import by name), and rank-side helpers
toy_stack      the engine tests' seeded stack of layers, ``Spec`` of a run, a run's digest
exact_adam     NaN-guarded placed inputs and the exact float32 replay of the CPU Adam kernel
hf_models      tiny ``transformers`` models (GPT-NeoX, Llama, MoE) and their training modes
slim_weights   GPT-NeoX slim-weights partitions written from a Hugging Face directory
neox_testing   the test data, a random GPT-NeoX, running neox's commands in or out of process
small_disk     a file system that is full, for the write-error tests
scratch_disk   directories for NVMe offload's scratch (a tmpfs of its own, a ramfs), and what
               a process holds of it
offload_stack  a toy stack through either front door; a stack whose plan is checked
stand_in_streams  the CUDA branches of offload on the CPU: stand-in streams and events
nvme_rank      a rank with its optimizer on NVMe, for the scratch's lifecycle
processes      the processes of a run a test started, found by an inherited variable
deepspeed_files  DeepSpeed files crafted as a hostile user would (the reader's fuzz cases)

The fixtures ``worlds``, ``world`` and ``device`` are in tests/conftest.py.
"""
