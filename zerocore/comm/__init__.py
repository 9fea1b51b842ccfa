"""How ranks find their devices and talk: ``device`` (where each rank computes, the platform),
``collectives`` (the c10d calls), ``peer_memory`` (gloo ranks of one host reading each other's
memory, with its deadlines), ``objects`` (Python values between ranks, on a device the caller
names), ``transport`` (the gather and reduce strategies a flat group uses,
chosen by ``zerocore.Comm``), ``agree`` (``run_agreed``: a step every rank finishes or every
rank fails)."""
