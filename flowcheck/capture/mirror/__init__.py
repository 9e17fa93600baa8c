"""Mirror capture (FlowCheck): training state rebuilt from switch-mirrored RoCEv2 allreduce traffic.

The modules follow the data: ``pcap``/``live`` read frames (``packet_ring``: the PACKET_MMAP rings),
``roce`` parses them natively and places packets in their RDMA writes, ``streams`` turns writes into
NCCL sends, ``ring`` is NCCL's ring schedule, ``assemble`` finds allreduces by structure,
``decode``/``streaming`` drive it offline and live, ``pipeline`` feeds the updater, ``stats`` counts
what went through, ``capacity`` sizes a node.  ``frames`` builds frames (simulator, tests); ``job`` is
the job description.  Nothing heavy is imported here.
"""
