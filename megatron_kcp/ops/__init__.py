"""The public op and its dispatch: ``kcp.gated_delta_rule`` (GDN and KDA, any CP layout) and ``dispatch``, which
picks the core, the exchange strategy and the segment split for each call. Above ``parallel`` and ``kernels``,
below ``layers``."""
