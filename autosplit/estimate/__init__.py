"""Estimating, for devices the user does not have: each block's FLOPs and bytes counted on
PyTorch's meta device (:mod:`~autosplit.estimate.op_counting`, without building the weights:
:mod:`~autosplit.estimate.meta_device`) and turned into a profile of the device described
(:mod:`~autosplit.estimate.analytic`, from :mod:`autosplit.specs`)."""
