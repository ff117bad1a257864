"""The GPT model, or the part of it one pipeline stage (or virtual stage) owns.

    ids [b, s] -> word + position embedding -> dropout -> [s, b, h]
               -> transformer layers -> final norm -> logits [s, b, v/tp] -> per-token loss [b, s]

The first stage owns the embedding; the last owns the final norm, the output layer and the
loss. With tied embeddings (the default, as GPT-2 and Megatron-LM) the output layer reuses the
word embedding; when first and last stage differ, the last stage keeps its own copy, created
from the same (seed, name) so both start equal, and the trainer all-reduces the two gradients.
"""
from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..tensor_parallel import (VocabParallelEmbedding, copy_to_tp, linear_with_sp_gather, scatter_to_sp, set_init,
                               vocab_parallel_cross_entropy)
from ..tensor_parallel.cross_entropy import EAGER, fused_vocab_parallel_cross_entropy
from ..tensor_parallel.layers import set_tp_attributes
from ..tensor_parallel.param_info import param_info
from ..tensor_parallel.wgrad import linear as wgrad_linear
from .attention import RotaryEmbedding
from .config import ExecutionConfig, GPTConfig
from ..context_parallel.sharding import causal_mask, chunk_positions
from .init import initialize_parameters
from .moe import MoELayer
from .mtp import MultiTokenPredictionBlock, mtp_objective
from .transformer import TransformerBlock

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class Embedding(nn.Module):
    # lookups (and dropout): backward needs the token ids, never the tables; ZeRO-3 does not
    # gather them again for it (distributed/zero3.py)
    backward_needs_params = False

    def __init__(self, config: GPTConfig, execution: ExecutionConfig, tp_group, rng_tracker=None, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, execution.sequence_parallel
        self.rng_tracker = rng_tracker
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, tp_group=tp_group, init_std=config.init_method_std,
            init_rows=config.vocab_size, dtype=execution.params_dtype, device=device)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    dtype=execution.params_dtype, device=device)
            set_init(self.position_embeddings.weight, "normal", config.init_method_std)
        else:
            self.position_embeddings = None

    def forward(self, input_ids, position_ids):
        x = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sp(x, self.tp_group)  # [s/tp, b, h]
        if not self.training or self.dropout == 0:
            return x
        # Replicated across TP, every rank must draw the same mask: the default generator, seeded
        # alike across TP. Sequence-sharded, each rank holds different tokens and needs its own
        # mask (the default generator would repeat one pattern on every shard): fork the tracker,
        # as Megatron-LM does.
        with self.rng_tracker.fork() if self.sequence_parallel else contextlib.nullcontext():
            return F.dropout(x, self.dropout, training=True)


class GPTModel(nn.Module):
    wgrad_store = None  # --delay-wgrad-compute: the output layer's weight gradient waits for W
    loss_kernels = EAGER  # the cross entropy's passes over 16-bit logits (--compile: compiled ones)

    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0, num_layers: int | None = None,
                 device=None, cp_group=None, execution: ExecutionConfig | None = None, ep_group=None,
                 token_group=None, etp_group="tp"):
        """`ep_group`: the expert-parallel ranks of MoE layers; `token_group`: the ranks that hold
        the rest of each micro-batch's tokens (TP under sequence parallelism, x CP), over which
        MoE routers sum their load statistics; `etp_group`: the ranks splitting each expert
        (--expert-tensor-parallel-size; "tp": `tp_group`; None, as any group: one rank)."""
        super().__init__()
        execution = ExecutionConfig() if execution is None else execution
        self.config, self.execution, self.tp_group, self.cp_group = config, execution, tp_group, cp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.input_tensor = None  # set by the pipeline schedule on stages after the first
        if config.position_embedding_type not in ("learned_absolute", "rope", "yarn"):
            raise ValueError(f"--position-embedding-type must be learned_absolute, rope or yarn, "
                             f"got {config.position_embedding_type!r}")
        if (rng_tracker is None and (comm.group_size(tp_group) > 1 or execution.sequence_parallel)
                and max(config.hidden_dropout, config.attention_dropout) > 0):
            # dropout on TP-sharded heads or sequence-sharded tokens must differ per TP rank
            raise ValueError("a tensor-parallel GPTModel with dropout needs rng_tracker "
                             "(megalite.tensor_parallel.seed_everything)")
        # multi-token prediction (model/mtp.py) sits with the loss; it needs the embedding there too
        self.mtp = (MultiTokenPredictionBlock(config, execution, tp_group, rng_tracker, device, cp_group, ep_group,
                                              token_group, etp_group) if post_process and config.mtp_num_layers else None)
        self.mtp_results = None  # the last forward's per depth (masked loss sum, tokens here, whole-sequence tokens)
        self.embedding = None
        if pre_process or self.mtp is not None:
            self.embedding = Embedding(config, execution, tp_group, rng_tracker, device)
        self.rotary = self._rotary(device)
        self.decoder = TransformerBlock(config, execution, tp_group, rng_tracker, layer_offset, num_layers,
                                        post_process, device, cp_group, ep_group, token_group, etp_group)
        self.output_layer = None
        # ZeRO-3 sets it (distributed/zero3.py TiedOutputGather) when the output layer is the word
        # embedding of this chunk: the projection then gathers the embedding for itself
        self.output_weight_gather = None
        if post_process and (config.untie_embeddings_and_output_weights or self.embedding is None):
            tp = comm.group_size(tp_group)
            weight = torch.empty(config.padded_vocab_size // tp, config.hidden_size, dtype=execution.params_dtype,
                                 device=device)
            self.output_layer = nn.Module()
            self.output_layer.weight = nn.Parameter(weight)
            set_tp_attributes(self.output_layer.weight, 0)
            set_init(self.output_layer.weight, "normal", config.init_method_std, rows=config.vocab_size)
            # a tied copy on the last stage: same name as the first stage's word embedding for
            # init and checkpoints, gradient summed with it over the embedding group
            param_info(self.output_layer.weight).tied_copy = not config.untie_embeddings_and_output_weights
        self._mark_shared(config)

    def _mark_shared(self, config: GPTConfig) -> None:
        """Tied embedding, or MTP's embedding, split over pipeline stages: both copies' gradients
        are summed over the embedding group (first and last stage) before the DP reduction; the
        last stage's copies are not saved (their names are the first stage's)."""
        if self.embedding is not None:
            param_info(self.embedding.word_embeddings.weight).embedding_or_output = True
        if self.output_layer is not None:
            param_info(self.output_layer.weight).embedding_or_output = True
        tied = not config.untie_embeddings_and_output_weights
        if self.pre_process and not self.post_process and (tied or config.mtp_num_layers):
            for p in self.embedding.parameters() if config.mtp_num_layers else [self.embedding.word_embeddings.weight]:
                param_info(p).embedding_group_sync = True
        if self.post_process and not self.pre_process:
            if self.embedding is not None:  # MTP's copy of the embedding (the tied output layer too)
                for p in self.embedding.parameters():
                    param_info(p).embedding_group_sync = param_info(p).tied_copy = True
            elif tied:
                param_info(self.output_layer.weight).embedding_group_sync = True

    # -- names -------------------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """Name of a parameter in the whole (unsplit) model: layer indices become global, and a
        last-stage copy of the tied embedding takes the embedding's name."""
        if local_name == "output_layer.weight" and param_info(self.output_layer.weight).tied_copy:
            return WORD_EMBEDDING
        return re.sub(r"^decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{int(m.group(1)) + self.layer_offset}.", local_name)

    def global_named_parameters(self):
        for name, p in self.named_parameters():
            yield self.global_name(name), p

    def global_named_buffers(self):
        """The persistent buffers (checkpointed; not RoPE's frequencies, not MoE token counts)."""
        for prefix, module in self.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield self.global_name(f"{prefix}.{name}" if prefix else name), buf

    def sharding_units(self) -> list[nn.Module]:
        """Sub-modules whose parameters ZeRO-3 gathers just for their own forward and backward,
        in forward order (distributed/zero3.py). The rest (final norm, an untied output layer) is
        gathered for the chunk's. When the word embedding is also this chunk's output layer, the
        output projection gathers it again for itself (`output_weight_gather`)."""
        mtp = list(self.mtp.layers) if self.mtp is not None else []
        if self.embedding is not None and not self.pre_process:  # MTP's copy: looked up after the decoder
            return list(self.decoder.layers) + [self.embedding] + mtp
        return ([self.embedding] if self.pre_process else []) + list(self.decoder.layers) + mtp

    def transformer_layers(self) -> list[nn.Module]:
        """The decoder's layers, then the MTP modules' transformer layers."""
        mtp = [m.transformer_layer for m in self.mtp.layers] if self.mtp is not None else []
        return list(self.decoder.layers) + mtp

    def moe_layers(self) -> list[tuple[int, nn.Module]]:
        """(global layer number, MoELayer) of this chunk's MoE layers (MTP's numbered after the decoder's)."""
        return [(layer.layer_number, layer.mlp) for layer in self.transformer_layers() if isinstance(layer.mlp, MoELayer)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' weights on this rank (reduced and ZeRO-sharded over the
        expert-data-parallel group, not DP x CP)."""
        return [p for _, layer in self.moe_layers() for p in layer.experts.parameters()]

    def output_weight_is_tied_here(self) -> bool:
        """The word embedding is this chunk's output layer too (tied, and the embedding here: one
        pipeline stage, or MTP's copy on the last)."""
        return (self.embedding is not None and self.post_process
                and not self.config.untie_embeddings_and_output_weights)

    def _rotary(self, device):
        c = self.config
        if c.multi_latent_attention:  # RoPE on the decoupled qk_pos_emb_head_dim channels (model/mla.py)
            return RotaryEmbedding(c.qk_pos_emb_head_dim, 1.0, c.rotary_base, None, None, device, c.yarn())
        return (RotaryEmbedding(c.kv_channels, c.rotary_percent, c.rotary_base, c.rope_scaling(),
                                c.rotary_seq_len_interpolation_factor, device, c.yarn())
                if c.uses_rope else None)

    def materialize_buffers(self, device) -> None:
        """A model built on the meta device (ZeRO-3 materialises its parameters): its buffers on
        `device`: RoPE's frequencies computed again, the others (MoE routers' counts and expert
        biases) zeros, their initial value."""
        if self.rotary is not None:
            self.rotary = self._rotary(device)
        for module in self.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)

    def initialize(self, seed: int) -> None:
        initialize_parameters(self.global_named_parameters(), seed, self.tp_group)

    # -- forward -----------------------------------------------------------------------------
    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def fusable_weights(self, device) -> list:
        """The output layer's weight where it has its own (untied, or the last stage's tied copy)
        and the projection is its only use (tensor_parallel/grad_fusion.py); not the word
        embedding (its lookup is autograd's) nor ZeRO-3's gathered tied projection."""
        return [self.output_layer.weight] if self.output_layer is not None and self.output_weight_gather is None else []

    def output_weight(self) -> torch.Tensor:
        return self.output_layer.weight if self.output_layer is not None else self.embedding.word_embeddings.weight

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None, loss_mask=None):
        """input_ids, position_ids, labels, loss_mask: [b, s]. Returns the per-token loss [b, s] when
        labels are given on the last stage, logits [s, b, v/tp] without them, and the hidden states
        [s, b, h] on other stages. Under context parallelism s is this rank's s/c tokens
        (context_parallel/sharding.slice_batch) and position_ids their global positions. With MTP
        (in training, with labels) `mtp_results` holds its per-depth losses (model/mtp.py)."""
        self.mtp_results = None
        shifted = mtp_embedded = None
        if self.mtp is not None and labels is not None and self.training:
            if loss_mask is None:
                loss_mask = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
            shifted = self.mtp.shifted(input_ids, position_ids, labels, loss_mask)
        if self.pre_process:
            x = self._embed(input_ids, position_ids, shifted)
            if shifted is not None:  # one lookup of the ids and their shifts (one ZeRO-3 gather)
                x, *mtp_embedded = x.chunk(1 + len(shifted), dim=1)
        else:
            x = self.input_tensor
        rotary, attention_mask = self._rotary_and_mask(x, position_ids, attention_mask)
        x = self.decoder(x, rotary, attention_mask)
        if not self.post_process:
            return x
        if shifted is not None:
            if mtp_embedded is None:  # MTP's copy of the embedding (last stage)
                mtp_embedded = self._embed(None, None, shifted).chunk(len(shifted), dim=1)
            self.mtp_results = self._mtp_losses(x, mtp_embedded, shifted, rotary, attention_mask)
        logits = self._logits(x)
        if labels is None:
            return logits
        return self._loss(logits, labels)

    def _embed(self, input_ids, position_ids, shifted):
        """Embeddings [s, b', h] of `input_ids` and, with MTP, of each depth's shifted ids, along b."""
        ids = [] if input_ids is None else [input_ids]
        pos = [] if input_ids is None else [position_ids]
        if shifted is not None:
            ids += [t[0] for t, _ in shifted]
            pos += [t[1] for t, _ in shifted]
        positions = None if any(p is None for p in pos) else torch.cat(pos, dim=0)
        return self.embedding(torch.cat(ids, dim=0), positions)

    def _rotary_and_mask(self, x, position_ids, attention_mask):
        rotary = None
        cp, cp_rank = comm.group_size(self.cp_group), comm.group_rank(self.cp_group)
        s = x.size(0) * (comm.group_size(self.tp_group) if self.execution.sequence_parallel else 1)  # local tokens
        if self.rotary is not None:
            if position_ids is None:
                pos = (chunk_positions(s * cp, cp, cp_rank, x.device) if cp > 1
                       else torch.arange(s, device=x.device))
                position_ids = pos.unsqueeze(0).expand(x.size(1), s)
            rotary = self.rotary(position_ids)
        if cp > 1 and attention_mask is None and "allgather" in self.execution.cp_comm_type and not self.config.dsa:
            # plain causal attention across the allgather CP group: causal in the global positions
            # (a2a and p2p layers mask from the positions themselves, context_parallel/; DSA from
            # its query and key positions, never an [s/c, s] tensor: model/dsa.py). Additive
            # (0 / -inf) in the activations' dtype, built once for every layer: SDPA would otherwise
            # convert a bool mask to this form in each layer and keep each copy for backward
            allowed = causal_mask(s, cp, cp_rank, x.device)
            attention_mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(
                ~allowed, float("-inf"))
        return rotary, attention_mask

    def _mtp_losses(self, x, embedded, shifted, rotary, attention_mask) -> list:
        """Per depth k: (sum of mask_k x CE_k here, with its graph; mask_k's tokens here; mask_k's tokens in
        the whole sequence), each module fed the previous one's output (model/mtp.py)."""
        results = []
        for layer, emb, ((_, _, labels, mask), whole_tokens) in zip(self.mtp.layers, embedded, shifted):
            x = layer(x, emb, rotary, attention_mask)
            loss = self._loss(self._logits(x), labels)  # [b, s]
            results.append(((loss.float() * mask).sum(), mask.sum(), whole_tokens))
        return results

    def _logits(self, x):
        """The output layer: [s, b, h] ([s/tp, b, h] under SP) -> logits [s, b, v/tp]."""
        sp_group = self.tp_group if self.execution.sequence_parallel else None
        if self.output_weight_gather is not None:  # ZeRO-3, tied: the embedding gathered for this product only
            return self.output_weight_gather.linear(x if sp_group else copy_to_tp(x, self.tp_group), sp_group)
        if sp_group is not None:  # the [s, b, h] gathered input is not kept for backward
            return linear_with_sp_gather(x, self.output_weight(), None, self.tp_group, self.wgrad_store)
        return wgrad_linear(copy_to_tp(x, self.tp_group), self.output_weight(), None, self.wgrad_store)

    def _loss(self, logits, labels):
        """Per-token cross entropy [b, s] of logits [s, b, v/tp] against labels [b, s]."""
        cross_entropy = (fused_vocab_parallel_cross_entropy if self.execution.cross_entropy_loss_fusion
                         else vocab_parallel_cross_entropy)
        # the logits are read no more: fp32 ones become their softmax in place
        loss = cross_entropy(logits, labels.transpose(0, 1), self.tp_group, self.config.vocab_size,
                             overwrite_logits=True, kernels=self.loss_kernels)
        return loss.transpose(0, 1)  # [b, s]

    def mtp_loss(self, main_tokens, microbatch_mean: bool):
        """After a training forward with MTP: (the micro-batch's MTP objective term, in the LM loss's
        normalisation, and [D, 2] of its per-depth (loss sum, tokens) here for the log); None otherwise."""
        if not self.mtp_results:
            return None
        term = mtp_objective(self.mtp_results, main_tokens, microbatch_mean, self.mtp.scale)
        stats = torch.stack([torch.stack([s.detach().double(), n.double()]) for s, n, _ in self.mtp_results])
        self.mtp_results = None
        return term, stats
