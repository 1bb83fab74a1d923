"""Methods gndpo adds to vLLM's workers (``worker_extension_cls``), called through ``collective_rpc``.

vLLM's ``reload_weights`` rebuilds each layer from the new checkpoint, layer by layer, and a layer
that loads nothing gets its previous kernel tensors back ("ParallelLMHead: Failed to load weights" in
the worker's log). A model with tied input and output embeddings (SmolLM2, Gemma 3, Qwen3 up to 4B,
Llama 3.2) stores the shared matrix once, under the input embedding's name, so its output layer is
such a layer: it keeps what it derived from the OLD matrix when the engine started (on CPU, a GEMM
kernel with its own packed copy of the weights), and the engine samples from the new body through the
previous round's output layer. :meth:`GndpoWorker.reload_policy` reloads, ties the output layer to the
new embedding again and rebuilds what it derives from it. gndpo's probe check
(:func:`gndpo.stages.models.live.probe_gap`) verifies the result every round whatever the architecture.
"""

from __future__ import annotations

from gndpo.pipeline.exec.signals import follow_owner

# vLLM imports this module in each of an engine's worker processes while it builds them: they die with
# the gndpo process the engine serves.
follow_owner()


class GndpoWorker:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner`` holds the model)."""

    def reload_policy(self, weights_path: str | None = None, weights: dict | None = None) -> int:
        """Load ``weights_path``'s checkpoint, or ``weights`` ({checkpoint name: tensor}, handed over in
        memory by an in-process caller), into the running model, tied output layers included; returns
        how many output layers were tied to the new embedding again (0 for an untied model)."""
        from vllm.config import set_current_vllm_config

        # As vLLM's own Worker.reload_weights does: layers built while the weights load (and the head's
        # kernels rebuilt below) read the engine's config from this context, not a default one.
        with set_current_vllm_config(self.vllm_config):
            if weights is not None:
                self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
            else:
                self.model_runner.reload_weights(weights_path=weights_path)
            return self._tie_output_layer()

    def _tie_output_layer(self) -> int:
        """Tie a tied model's output layer to its reloaded embedding again and rebuild its kernels; 1
        where it did, 0 for an untied model or an unusual shape."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        if not getattr(getattr(config, "text_config", None) or config, "tie_word_embeddings", False):
            return 0
        heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
        embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
        if len(heads) != 1 or len(embeddings) != 1:
            return 0  # not the usual one-embedding, one-head shape; gndpo's probe check catches a stale engine
        head = heads[0].tie_weights(embeddings[0])
        # Rebuild what the head derived from its weight when it was first loaded (on CPU: a GEMM
        # kernel holding its own packed copy of the matrix).
        head.quant_method.process_weights_after_loading(head)
        return 1

    def forget_reload_records(self) -> int:
        """Drop what vLLM recorded of this model's layers to reload them (vllm 0.32's ``LAYERWISE_INFO``,
        weak-keyed by layer); returns how many records went. After a reload each record holds weight
        loaders wrapped in a closure over its layer, so it keeps its own key, and with it the whole
        model, alive after the engine has gone (0.85 GiB per SmolLM2 135M engine): for an engine in the
        caller's process, called as it shuts down (:func:`gndpo.stages.models.vllm_engine.shutdown_llm`)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        return sum(LAYERWISE_INFO.pop(layer, None) is not None for layer in self.model_runner.get_model().modules())
