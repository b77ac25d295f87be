"""Calibration for quantize="int8-static": the range of every engine Linear's input, per input channel, over a set
of texts, kept on the layer as `input_range` [2, in] (minimum, maximum) for engine/quantize.py's static scales.

The texts are model_kwargs["calibration"] (a list of strings, what the model will embed is best), else TEXTS:
sentences, questions and passages of everyday, technical and scientific English of 1 to 52 words, written for
this purpose. The pass runs in PyTorch's own fp32 products, so the ranges are the unquantized model's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from st_fastbackend.engine.layers import Linear
from st_fastbackend.engine.spec import UnsupportedModelError

PACK = 16  # texts per calibration pack

TEXTS = (
    "How do I reset my password?",
    "The cat sat on the warm windowsill all afternoon.",
    "what is the capital of australia",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Best budget laptop for students in 2026",
    "The committee postponed its decision until the next quarterly meeting, citing incomplete financial reports.",
    "Is it safe to take ibuprofen with coffee?",
    "A transformer encoder maps a sequence of tokens to a sequence of contextual vectors.",
    "Mitochondrial DNA is inherited almost exclusively from the mother in most animals.",
    "Preheat the oven to 180 degrees, then bake the bread for forty minutes until golden.",
    "error: cannot find module 'react' imported from /src/index.js",
    "The Treaty of Westphalia in 1648 ended the Thirty Years' War and reshaped the political map of Europe.",
    "Vaccination reduced the incidence of measles by more than ninety percent within a decade.",
    "Who wrote Pride and Prejudice?",
    "Our quarterly revenue grew 12% year over year, driven by subscriptions in Asia and Latin America.",
    "Rainfall in the region has declined steadily, and farmers are switching to drought-resistant crops.",
    "def mean(values): return sum(values) / len(values)",
    "The patient presented with fever, cough and shortness of breath lasting three days.",
    "Quantum entanglement links the states of two particles regardless of the distance between them.",
    "Please find attached the signed contract and the invoice for March.",
    "Cheap flights from Berlin to Lisbon in May",
    "The enzyme's activity dropped sharply above 45 °C, consistent with thermal denaturation of its active site.",
    "She has played the violin since she was four and now performs with the city orchestra.",
    "Why is the sky blue?",
    "Increased expression of the protein was associated with poor prognosis in patients with gastric cancer.",
    "The bridge, completed in 1932, carries six lanes of traffic and two railway tracks across the harbour.",
    "Symptoms of vitamin D deficiency include fatigue, bone pain and muscle weakness.",
    "To install the package, run pip install and restart the kernel.",
    "The novel follows three generations of a family through war, emigration and return.",
    "Interest rates were left unchanged as inflation eased for the fourth consecutive month.",
    "Neurons communicate through electrical impulses and chemical signals at synapses.",
    "Return policy: items may be returned within 30 days with the original receipt.",
    "The study randomised 1,204 adults to either the intervention or usual care and followed them for five years. "
    "The primary outcome, a composite of cardiovascular events, occurred in 8.1% of the intervention group and "
    "10.4% of the control group; adverse events were similar between groups.",
    "Volcanic eruptions inject sulfur dioxide into the stratosphere, where it forms aerosols that reflect sunlight "
    "and can cool the global climate for a year or two. The 1991 eruption of Mount Pinatubo lowered average "
    "temperatures by about half a degree.",
    "The library's new opening hours are 9 am to 8 pm on weekdays and 10 am to 4 pm on Saturdays. It is closed on "
    "Sundays and public holidays. Members can borrow up to twelve items at a time and renew them online.",
    "In distributed systems, consensus algorithms such as Paxos and Raft let a group of machines agree on a single "
    "value even when some of them fail. Raft separates leader election, log replication and safety, which makes it "
    "easier to understand and implement correctly than Paxos.",
    "Chocolate chip cookies: cream the butter and sugar, beat in the eggs and vanilla, fold in the flour, baking soda "
    "and salt, then the chocolate. Chill the dough for an hour, scoop it onto a tray and bake for eleven minutes.",
    "The river rises in the mountains to the north and flows south for some 400 kilometres through forests, farmland "
    "and three major cities before reaching the sea. Its delta is a protected wetland, home to hundreds of bird "
    "species, and its lower course has been dredged for shipping since the nineteenth century.",
    "Antibiotic resistance arises when bacteria survive exposure to a drug and pass on the mutations or acquired "
    "genes that let them do so. Overuse in medicine and agriculture accelerates the process; new drug classes have "
    "been rare since the 1980s, and surveillance programmes track resistant strains in hospitals worldwide.",
    "The startup raised a second round of funding to expand its delivery network. Its founders say the money will go "
    "to new warehouses, electric vans and hiring, and that they expect to be profitable in two years, although "
    "analysts point to rising costs and fierce competition from established retailers.",
    "ok",
    "Thanks!",
    "Breaking: earthquake of magnitude 6.1 strikes off the coast; no tsunami warning issued.",
    "Can dogs eat grapes?",
    "Solar panels convert sunlight into electricity using semiconductor cells, usually made of silicon.",
    "The museum's collection includes paintings, sculptures, manuscripts and more than ten thousand coins.",
    "Regular exercise lowers blood pressure and improves insulin sensitivity in adults with type 2 diabetes.",
    "He missed the last train and walked home through the empty streets, thinking about what she had said.",
    "Compare the time complexity of quicksort and mergesort in the worst case.",
)


def calibration_texts(model_kwargs: dict, quantize: str | None) -> Sequence[str] | None:
    """The texts to calibrate on for quantize="int8-static" (model_kwargs["calibration"] or TEXTS); None for any
    other mode, where model_kwargs["calibration"] is refused (it would change nothing)."""
    texts = model_kwargs.get("calibration")
    if quantize != "int8-static":
        if texts is not None:
            raise UnsupportedModelError(f"model_kwargs['calibration'] with quantize={quantize!r} (only "
                                        "quantize='int8-static' calibrates)")  # fmt: skip
        return None
    if texts is None:
        return TEXTS
    if isinstance(texts, str) or not texts or not all(isinstance(text, str) and text for text in texts):
        raise UnsupportedModelError("model_kwargs['calibration'] must be a non-empty list of non-empty strings")
    return list(texts)


def calibrate(model: nn.Module, run: Callable[[Sequence[str]], None], texts: Sequence[str] = TEXTS) -> None:
    """Set `input_range` on every Linear of `model` from its inputs while run(pack) embeds the texts, PACK at a time,
    with PyTorch's fp32 products in the Linear layers (each layer's products are restored after) and attention as the
    int8 model runs it (quantize.attention_products)."""
    layers = [layer for layer in model.modules() if isinstance(layer, Linear)]
    ranges: dict[Linear, Tensor] = {}

    def record(layer: Linear, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        seen = torch.stack([x.amin(dim=0), x.amax(dim=0)])  # [2, in]
        if layer in ranges:
            seen = torch.stack([torch.minimum(ranges[layer][0], seen[0]), torch.maximum(ranges[layer][1], seen[1])])
        ranges[layer] = seen

    products = [layer.product_dtype for layer in layers]
    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        for layer in layers:
            layer.product_dtype = None
        with torch.inference_mode():
            for start in range(0, len(texts), PACK):
                run(texts[start : start + PACK])
    finally:
        for hook in hooks:
            hook.remove()
        for layer, product in zip(layers, products, strict=True):
            layer.product_dtype = product
    for layer in layers:
        layer.input_range = ranges.get(layer)
        layer.drop_copies()  # made again with the ranges at the next product
