"""Commands built on the runtime: generate, eval, eval-context, bench, check-trt."""
