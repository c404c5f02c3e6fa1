"""timm VisionTransformer (DeiT): cls/reg tokens, learned pos embed, conv patch embed, fused qkv
stored (out, in) as [q; k; v], classifier head (untied)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, UnsupportedModelError
from .base import Family, Recipe, Sizes

QKV = ("heads", "heads", "heads")


class ViT(Family):
    name = "vit"
    layers = "blocks"
    residual_writers = r"(attn\.proj|mlp\.fc2)\.(weight|bias)"
    attention_output = "attn.proj"  # its input is the per-head attention output
    task = "image_cls"
    top_params = {
        r"(cls_token|reg_token|pos_embed)": (None, None, "hidden"),
        r"patch_embed\.proj\.weight": ("hidden", None, None, None),
        r"patch_embed\.proj\.bias": ("hidden",),
        r"(norm_pre|norm|fc_norm)\.(weight|bias)": ("hidden",),
        r"head\.weight": (None, "hidden_in"),
        r"head\.bias": (None,),
    }
    block_params = {
        r"norm[12]\.(weight|bias)": ("hidden",),
        r"attn\.qkv\.weight": (QKV, "hidden_in"),
        r"attn\.qkv\.bias": (QKV,),
        r"attn\.[qk]_norm\.(weight|bias)": (None,),  # over head_dim, shared by all heads
        r"attn\.proj\.weight": ("hidden", "heads_in"),
        r"(attn\.proj|mlp\.fc2)\.bias": ("hidden",),
        r"mlp\.fc1\.weight": ("ffn", "hidden_in"),
        r"mlp\.fc1\.bias": ("ffn",),
        r"mlp\.fc2\.weight": ("hidden", "ffn_in"),
        r"ls[12]\.gamma": ("hidden",),
    }

    def matches(self, model: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return type(model) is VisionTransformer

    def recipe(self, model: nn.Module) -> Recipe:
        """Read the constructor arguments back off the modules (timm keeps no config)."""
        block = model.blocks[0]
        pe = model.patch_embed
        kwargs = dict(
            img_size=list(pe.img_size),
            patch_size=list(pe.patch_size),
            in_chans=pe.proj.in_channels,
            num_classes=model.num_classes,
            global_pool=model.global_pool,
            embed_dim=model.embed_dim,
            depth=len(model.blocks),
            num_heads=block.attn.num_heads,
            mlp_ratio=block.mlp.fc1.out_features / model.embed_dim,
            qkv_bias=block.attn.qkv.bias is not None,
            qk_norm=not isinstance(block.attn.q_norm, nn.Identity),
            proj_bias=block.attn.proj.bias is not None,
            init_values=1e-5 if hasattr(block.ls1, "gamma") else None,
            class_token=model.cls_token is not None,
            pos_embed="learn" if model.pos_embed is not None else "none",
            no_embed_class=model.no_embed_class,
            reg_tokens=model.num_reg_tokens,
            pre_norm=not isinstance(model.norm_pre, nn.Identity),
            final_norm=not isinstance(model.norm, nn.Identity),
            fc_norm=not isinstance(model.fc_norm, nn.Identity),
            dynamic_img_size=model.dynamic_img_size,
            drop_rate=model.head_drop.p,
            pos_drop_rate=model.pos_drop.p,
            attn_drop_rate=block.attn.attn_drop.p,
            proj_drop_rate=block.attn.proj_drop.p,
        )
        recipe = Recipe(type(model), kwargs)
        self._check_rebuilds(model, recipe)
        return recipe

    def _check_rebuilds(self, model: nn.Module, recipe: Recipe) -> None:
        with torch.device("meta"):
            rebuilt = self.build(recipe)
        want = {n: tuple(p.shape) for n, p in model.state_dict().items()}
        got = {n: tuple(p.shape) for n, p in rebuilt.state_dict().items()}
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()))[:6]
            raise UnsupportedModelError(
                f"this VisionTransformer uses options the vit family cannot rebuild (first differences: {diff})"
            )

    def sizes(self, model_or_recipe) -> Sizes:
        kw = self._recipe(model_or_recipe).config
        hidden, heads = kw["embed_dim"], kw["num_heads"]
        return Sizes(kw["depth"], heads, heads, hidden, int(hidden * kw["mlp_ratio"]), hidden // heads)

    def resize(self, recipe: Recipe, sizes: Sizes) -> Recipe:
        kw = dict(recipe.config, depth=sizes.layers, num_heads=sizes.heads, embed_dim=sizes.hidden)
        kw["mlp_ratio"] = sizes.ffn / sizes.hidden
        return Recipe(recipe.cls, kw)

    def build(self, recipe: Recipe) -> nn.Module:
        return recipe.cls(**recipe.config)

    def option_problem(self, options: dict) -> str | None:
        """Why ``options`` cannot go to timm's VisionTransformer: a keyword it does not take, or one
        the model section owns (its sizes)."""
        import inspect

        from timm.models.vision_transformer import VisionTransformer

        owned = sorted({"embed_dim", "depth", "num_heads", "mlp_ratio"} & set(options))
        if owned:
            return f"{owned} set the model's size: use the model section (layers, heads, hidden, ffn)"
        known = set(inspect.signature(VisionTransformer.__init__).parameters) - {"self", "kwargs"}
        unknown = sorted(set(options) - known)
        return f"timm VisionTransformer takes no {unknown}" if unknown else None

    def new(self, sizes: Sizes, **options) -> nn.Module:
        from timm.models.vision_transformer import VisionTransformer

        if sizes.kv_heads != sizes.heads or sizes.head_dim * sizes.heads != sizes.hidden:
            raise ValueError("timm ViT has no GQA and head_dim = hidden / heads")
        kw = dict(embed_dim=sizes.hidden, depth=sizes.layers, num_heads=sizes.heads, mlp_ratio=sizes.ffn / sizes.hidden)
        return VisionTransformer(**kw, **options)

    def attention_kernel(self, model: nn.Module) -> str:
        """timm's attention calls scaled_dot_product_attention when ``fused_attn`` is set (its default)."""
        return "sdpa" if all(block.attn.fused_attn for block in model.blocks) else "eager"

    def save(self, model: nn.Module, directory) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        config = {"mlresearch_family": self.name, "timm_class": "VisionTransformer", "kwargs": self.recipe(model).config}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    def saved_by(self, config: dict) -> bool:
        return config.get("mlresearch_family") == self.name and config.get("timm_class") == "VisionTransformer"

    def load(self, directory, config: dict) -> nn.Module:
        from safetensors.torch import load_file
        from timm.models.vision_transformer import VisionTransformer

        state = load_file(str(Path(directory) / "model.safetensors"))
        with torch.device("meta"):
            model = VisionTransformer(**config["kwargs"])
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {directory}: weights do not match config (missing {missing}, "
                                  f"unexpected {unexpected})")
        return model.eval()

    def random_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        """Images of the model's own input shape (``seq_len`` does not apply)."""
        pe = model.patch_embed
        return {"x": torch.randn(batch, pe.proj.in_channels, *pe.img_size, generator=generator)}

    def data_options(self, vocab_size, seq_len, special) -> dict:
        return dict(img_size=28, patch_size=4, in_chans=1, num_classes=10)  # MNIST; model.options override

    def forward_flops(self, model: nn.Module, seq_len=None) -> dict[str, float]:
        """T = patches + class/register tokens; the patch embedding adds 2 (C p^2) d per patch and
        the classifier 2 d classes once per image."""
        s, pe = self.sizes(model), model.patch_embed
        patches = pe.num_patches
        conv = 2 * pe.proj.in_channels * pe.patch_size[0] * pe.patch_size[1] * s.hidden * patches
        return {**self._block_flops(s, patches + model.num_prefix_tokens), "head": float(2 * s.hidden * model.num_classes),
                "patch_embed": float(conv)}

    def forward_with_attention(self, model: nn.Module, inputs: dict):
        """timm's fused attention returns no maps: a pre-hook on each ``attn`` recomputes
        ``softmax(q k^T * scale)`` from its input with the module's own weights (and q/k norms),
        which leaves the outputs unchanged."""
        import torch

        maps: list = []

        def hook(attn, args):
            x = args[0]
            b, n, _ = x.shape
            qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
            maps.append(torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1))

        handles = [block.attn.register_forward_pre_hook(hook) for block in model.blocks]
        try:
            output = model(inputs["x"])
        finally:
            for h in handles:
                h.remove()
        b, t = maps[0].shape[0], maps[0].shape[-1]
        return output, maps, torch.ones(b, t, dtype=torch.bool)
