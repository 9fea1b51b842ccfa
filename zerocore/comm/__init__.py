"""How ranks find their devices and talk: ``device`` (where each rank computes, the platform),
``collectives`` (c10d calls, deadlines, the on-host memory reads), ``transport`` (the gather and
reduce strategies a flat group uses, chosen by ``zerocore.Comm``), ``agree`` (``run_agreed``: a
step every rank finishes or every rank fails)."""
