"""The machinery of the trajectory methods.

The shared base of the methods that replay a recorded training run
(:class:`~dattri_llm.attribution.trajectory.base.TrajectoryAttributor`, in ``base``), the
linearised optimizer steps and their sweeps (``unroll``), curvature inside a step
(``curvature``), the captured run's loss reduction (``reduction``) and the live path's recorded
run (``training``). The methods themselves (``adamw_influence``, ``dvemb``) sit one level up.
"""
