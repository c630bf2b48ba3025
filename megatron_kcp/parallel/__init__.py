"""The CP machinery: the collectives (``comm``), the conv halo (``halo``), the autograd step (``step``) and the
exchange strategies behind one base (``strategy``: ``relay``, ``gather``, ``cp2hp``, ``fla_cp``, ``single``,
``relayout_exchange``), the layout moves (``relayout``) and the cost model that weighs them (``cost_model``).
Above ``kernels``, below ``ops``."""
