"""zpp: a pipeline-parallel LLM serving engine."""
from zpp.outputs import CompletionOutput, RequestOutput
from zpp.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):  # keep `import zpp` light: the LLM class pulls in the engine
    if name == "LLM":
        from zpp.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
