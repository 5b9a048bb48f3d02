"""The score engine every attributor runs on.

The blocked score loop, chunk planning, sinks (full matrix or streamed top-k), the prepared
test side, resumable checkpoints and the distributed split of the train side.

Nothing here knows an attribution method: the loop calls the few methods of
:class:`~dattri_llm.attribution.engine.protocol.ScoringMethod` that an attributor provides.
"""
