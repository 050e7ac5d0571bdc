"""Streaming deltas: text that may be the start of a stop string is held back until the choice
finishes, so the joined deltas equal the final (cut) text."""

from pagedserve.entrypoints.openai.streaming import ChoiceState
from pagedserve.sampling_params import SamplingParams


def joined(steps, final, holdback):
    state = ChoiceState(holdback)
    sent = [state.next_text(text, False) for text in steps]
    sent.append(state.next_text(final, True))
    return sent


def test_a_stop_string_prefix_is_never_sent_before_the_stop_matches():
    holdback = SamplingParams(stop=["STOP"]).output_text_buffer_length
    assert holdback == 3
    # The engine's text grows "ab", "abST", "abSTO", then "STOP" matches and is cut: "ab".
    sent = joined(["ab", "abST", "abSTO"], "ab", holdback)
    assert "".join(sent) == "ab" and "S" not in "".join(sent)


def test_held_back_text_that_was_not_a_stop_is_sent_later_or_at_the_end():
    sent = joined(["he", "hello", "hello wor"], "hello world", 3)
    assert sent == ["", "he", "llo ", "world"]
    assert "".join(sent) == "hello world"


def test_without_stop_strings_every_step_sends_its_new_text():
    params = SamplingParams(stop=["xyz"], include_stop_str_in_output=True)
    assert params.output_text_buffer_length == 0
    assert joined(["a", "ab", "abc"], "abc", 0) == ["a", "b", "c", ""]
