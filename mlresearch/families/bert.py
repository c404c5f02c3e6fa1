"""HF BERT for masked LM: post-LN blocks; the MLM decoder is tied to the word embeddings."""

from .base import HFFamily


class BERT(HFFamily):
    name = "bert"
    classes = ("BertForMaskedLM",)
    config_class = "BertConfig"
    sequence_classifier = "BertForSequenceClassification"
    classifier_fresh = ("classifier.", "bert.pooler.")  # the head and the pooler BertForMaskedLM has none of
    layers = "bert.encoder.layer"
    residual_writers = r"(attention\.)?output\.dense\.(weight|bias)"
    attention_output = "attention.output.dense"  # its input is the per-head attention output
    norm_position = "post"  # LN(x + f(x)): a zero f still re-normalises x
    task = "masked_lm"
    head_transform = True
    encoder, output_head = "bert", "cls"  # BertForMaskedLM: self.cls(self.bert(...)[0])
    top_params = {
        r"bert\.embeddings\.(word|position|token_type)_embeddings\.weight": (None, "hidden"),
        r"bert\.embeddings\.LayerNorm\.(weight|bias)": ("hidden",),
        r"cls\.predictions\.transform\.dense\.weight": ("hidden", "hidden_in"),
        r"cls\.predictions\.transform\.dense\.bias": ("hidden",),
        r"cls\.predictions\.transform\.LayerNorm\.(weight|bias)": ("final_norm",),
        r"cls\.predictions\.decoder\.weight": (None, "hidden_in"),  # only seen when untied
        r"cls\.predictions\.(decoder\.)?bias": (None,),
    }
    block_params = {
        r"attention\.self\.(query|key|value)\.weight": ("heads", "hidden_in"),
        r"attention\.self\.(query|key|value)\.bias": ("heads",),
        r"attention\.output\.dense\.weight": ("hidden", "heads_in"),
        r"(attention\.)?output\.dense\.bias": ("hidden",),
        r"(attention\.)?output\.LayerNorm\.(weight|bias)": ("hidden",),
        r"intermediate\.dense\.weight": ("ffn", "hidden_in"),
        r"intermediate\.dense\.bias": ("ffn",),
        r"output\.dense\.weight": ("hidden", "ffn_in"),
    }

    def data_options(self, vocab_size, seq_len, special):
        return {"vocab_size": vocab_size, "max_position_embeddings": seq_len, "pad_token_id": special.get("pad", 0)}
