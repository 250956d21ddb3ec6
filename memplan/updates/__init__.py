"""The optimizer's update inside the plan: what it holds, what it allocates, and how it runs.

With ``memplan.optimize(model, budget, optimizer=opt)`` the budget covers the
whole training step, forward through the last parameter update, and memplan
applies the update itself, inside backward. That takes three things, each
here:

* **What the update costs** (`memplan.updates.probe.learn_updates`): per parameter, the bytes of
  optimizer state the optimizer keeps for it, the bytes its update
  allocates while it runs, and a time (a roofline, or timed with ``profile=True``),
  beside one optimizer call's fixed time, paid once per bucket. They are learned, not
  looked up: a fresh instance of the optimizer's own class with the
  parameter group's hyperparameters steps two small parameters of the same
  dtype and device under `memplan.measure.tracker.MemoryTracker`, and the bytes
  are fitted as ``fixed + per_element * numel`` (so a 1.3B-parameter model
  is costed without allocating it). Any ``torch.optim`` optimizer, and any
  other with the same interface, is learned the same way; one that cannot be
  stepped so raises `UnsupportedOptimizer` naming it.
* **Where the update sits in the plan** (`memplan.planning.lowering.lower`): each
  parameter's state is a source (resident for the whole step, as it is
  across steps), and its bucket's update is a value that reads the parameter's
  gradient, so the gradient is freed once it has been applied: as soon as
  the bucket's last gradient is final, in the Problem's order. The update writes the parameter in
  place, so no computation may read the parameter after it; a schedule that
  places one too early (a backward op or a recomputation still reads the
  weight) gets it moved after that read (`solvers.transforms.ordering`).
  Where that puts the plan over the budget, every update waits instead for
  all gradients of the step (``GRADS_FINAL``), as ``optimizer.step()``
  after ``backward()`` would.
* **Which parameters one call updates** (`memplan.updates.buckets`): a bucket is
  a run of parameters whose gradients are final one after another, updated by
  one optimizer call (a ``foreach`` or ``fused`` optimizer then launches each
  op once for all of them). Its early gradients wait for its last, and one
  call's temporaries over it are learned as the rest are (how much of earlier
  parameters' temporaries is alive at a later one's peak); the plan tries one
  bucket for the step, then smaller ones, then one call per parameter, and
  keeps the first that fits without recomputing (`memplan.pipeline.plan.whole_step_plan`).
* **How it runs** (`memplan.updates.runner.UpdateRunner`): the backward segment calls it at the
  bucket's place in the schedule with its gradients; it runs the user's own
  optimizer once on those parameters (its ``param_groups`` read at that moment,
  so an LR scheduler or ``add_param_group`` takes effect) and drops the
  gradients.

The training-loop contract: ``loss.backward()`` updates the parameters the
optimizer holds and leaves their ``.grad`` at ``None``; ``optimizer.step()``
and ``optimizer.zero_grad()`` then find no gradients and change nothing, so
the usual loop gives the parameters eager PyTorch gives. With
``grad_norm=True`` the L2 norm of the gradients applied in the last step is
kept (`UpdateRunner.grad_norm`, ``OptimizedModule.grad_norm``) for logging;
it costs one device scalar that the plan does not count. Step hooks
registered on the optimizer run once per bucket. ``max_grad_norm=`` clips
exactly as ``torch.nn.utils.clip_grad_norm_`` over the gradients the optimizer
applies: the global norm needs every gradient, so the updates then wait for
the end of backward (`UpdateRunner.clip` runs at ``GRADS_FINAL``).
"""
