"""The τ²-bench environment (trl_dta.envs): dataset, tools, offline user, reward vs τ²'s own evaluator, and
one TreePPOTrainer step with `environment_factory` on a tiny model with scripted generation. No LLM, no
hub."""

from __future__ import annotations

import functools
import inspect
import json
import pickle
import subprocess
import sys
import time
from collections import Counter

import pytest

pytest.importorskip("tau2")

import torch
from transformers.utils import get_json_schema

from trl_dta.envs import LLMUser, ScriptedUser, Tau2Environment, load_tau2_dataset
from trl_dta.envs.tau2.domain import get_domain
from trl_dta.envs.tau2.users import AGENT_GREETING, STOP, TRANSFER

# Yusuf Rossi, zip 19122: exchange two items of delivered order #W2378156 (5 gold actions)
EXCHANGE_TASK = "0"


def _domain():
    return get_domain("retail")


def _task(task_id):
    return _domain().tasks[task_id]


def _row(task_id, policy=False):
    """A dataset row for a task, as TRL passes it to reset()."""
    t = _task(task_id)
    opening = ScriptedUser(t).opening
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": opening}]
    return {"prompt": prompt, "task_id": task_id, "domain": "retail"}


def _play_gold(env, task_id, drop=(), replace=None, say_info=True):
    """Reset `env` on a task and replay its gold actions through the tool methods (`drop`: indices to skip,
    `replace`: {index: new arguments}), then send the required information to the user."""
    env.reset(**_row(task_id))
    crit = _task(task_id).evaluation_criteria
    for i, action in enumerate(crit.actions):
        if i in drop:
            continue
        args = (replace or {}).get(i, action.arguments)
        getattr(env, action.name)(**args)
    if say_info and crit.communicate_info:
        env.send_message_to_user("To sum up: " + ", ".join(crit.communicate_info) + ".")
    return env


def _write_tasks(n_with_info, n_without):
    d = _domain()
    with_info, without = [], []
    for tid, t in d.tasks.items():
        if not any(a.name in d.write_tools for a in t.evaluation_criteria.actions or []):
            continue
        (with_info if t.evaluation_criteria.communicate_info else without).append(tid)
    return with_info[:n_with_info] + without[:n_without]


# ------------------------------------------------------------------------------------------------------------
# Cross-check: the same episode scored by τ²'s own evaluator classes
# ------------------------------------------------------------------------------------------------------------
def _tau2_messages(env) -> list:
    """The episode as a τ² message trajectory (greeting, opening, tool calls and results, messages)."""
    from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage

    init = env._task.initial_state
    history = list(init.message_history or []) if init is not None else []
    messages = history or [AssistantMessage(role="assistant", content=AGENT_GREETING)]
    for kind, value in env._events:
        if kind == "call":
            c = env._calls[value]
            tc = ToolCall(id=f"call_{value}", name=c.name, arguments=c.arguments, requestor="assistant")
            messages.append(AssistantMessage(role="assistant", tool_calls=[tc]))
            messages.append(ToolMessage(id=tc.id, role="tool", content=c.content, requestor="assistant",
                                        error=c.error))  # fmt: skip
        elif kind == "agent":
            messages.append(AssistantMessage(role="assistant", content=value))
        else:
            messages.append(UserMessage(role="user", content=value))
    return messages


def tau2_reference_reward(env) -> float:
    """The episode's task reward (no shaping) computed by τ²'s own evaluator classes: EnvironmentEvaluator
    (replays the trajectory and the gold actions on databases loaded from τ²'s files), ActionEvaluator and
    CommunicateEvaluator, combined over the task's reward basis as ``tau2.evaluator.evaluator.
    evaluate_simulation`` does for ``EvaluationType.ALL`` (without importing it: it imports litellm). Slow
    (reloads the database twice)."""
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator_action import ActionEvaluator
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    if env._task is None or env._termination in ("too_many_errors", "error"):
        return 0.0
    task = env._task
    if task.evaluation_criteria is None:
        return 1.0
    trajectory = _tau2_messages(env)
    module = env._d.module
    env_info = EnvironmentEvaluator.calculate_reward(
        environment_constructor=lambda solo_mode=False: module.get_environment(solo_mode=solo_mode),
        task=task, full_trajectory=trajectory,
    )  # fmt: skip
    basis = set(task.evaluation_criteria.reward_basis)
    reward = 1.0
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        reward *= env_info.reward
    if basis & {RewardType.ACTION}:
        reward *= ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory).reward
    if basis & {RewardType.COMMUNICATE}:
        reward *= CommunicateEvaluator.calculate_reward(task=task, full_trajectory=trajectory).reward
    return reward


# ------------------------------------------------------------------------------------------------------------
# Package, dataset, tools
# ------------------------------------------------------------------------------------------------------------
def test_importing_trl_dta_envs_does_not_import_tau2():
    code = "import sys, trl_dta.envs as e; e.ScriptedUser; assert 'tau2' not in sys.modules, 'tau2 imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_dataset_splits_filtering_and_rows():
    train, test = load_tau2_dataset(split="train"), load_tau2_dataset(split="test")
    train_all = load_tau2_dataset(split="train", write_only=False)
    test_all = load_tau2_dataset(split="test", write_only=False)
    d = _domain()
    assert (len(train_all), len(test_all)) == (74, 40)  # τ²'s own retail split
    assert not set(train_all["task_id"]) & set(test_all["task_id"])
    assert len(set(train_all["task_id"]) | set(test_all["task_id"])) == 114
    assert set(train["task_id"]) <= set(train_all["task_id"])
    assert set(test["task_id"]) <= set(test_all["task_id"])
    # write_only keeps exactly the tasks whose gold actions include a tool τ² types as WRITE
    for ds_all, ds in ((train_all, train), (test_all, test)):
        for tid in ds_all["task_id"]:
            has_write = any(a.name in d.write_tools for a in d.tasks[tid].evaluation_criteria.actions or [])
            assert has_write == (tid in set(ds["task_id"]))
    assert (len(train), len(test)) == (68, 37)
    assert d.write_tools == {
        "cancel_pending_order", "exchange_delivered_order_items", "modify_pending_order_address",
        "modify_pending_order_items", "modify_pending_order_payment", "modify_user_address",
        "return_delivered_order_items",
    }  # fmt: skip
    row = train[0]
    assert set(row) >= {"prompt", "task_id", "domain"} and isinstance(row["task_id"], str)
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "<policy>" in row["prompt"][0]["content"] and "send_message_to_user" in row["prompt"][0]["content"]
    assert row["prompt"][1]["content"] == ScriptedUser(d.tasks[row["task_id"]]).opening
    short = load_tau2_dataset(max_tasks=3, seed=1, policy=False, greeting=True)
    assert len(short) == 3 and short["task_id"] == load_tau2_dataset(max_tasks=3, seed=1)["task_id"]
    assert "<policy>" not in short[0]["prompt"][0]["content"]
    assert [m["role"] for m in short[0]["prompt"]] == ["system", "assistant", "user"]
    mock_train, mock_test = (load_tau2_dataset("mock", split=s, write_only=False) for s in ("train", "test"))
    assert len(mock_train) and len(mock_test) and not set(mock_train["task_id"]) & set(mock_test["task_id"])


def test_tools_are_the_domain_tools_with_schemas_trl_accepts():
    env = Tau2Environment(domain="retail")
    assert type(env).__name__ == "Tau2RetailEnvironment" and isinstance(env, Tau2Environment)
    # exactly what TRL's environment_factory exposes as tools
    exposed = [n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
               if n not in ("reset", "get_reward") and not n.startswith("_")]  # fmt: skip
    toolkit = _domain().shared.tools
    assert set(exposed) == set(toolkit.get_tools()) | {"send_message_to_user"}
    for name in exposed:
        schema = get_json_schema(getattr(env, name))["function"]
        if name == "send_message_to_user":
            assert schema["parameters"]["required"] == ["message"]
            continue
        params = inspect.signature(getattr(toolkit, name)).parameters
        assert list(schema["parameters"]["properties"]) == list(params)
        assert schema["description"] and all(
            p["description"] for p in schema["parameters"]["properties"].values()
        )
    properties = get_json_schema(env.exchange_delivered_order_items)["function"]["parameters"]["properties"]
    items = properties["item_ids"]
    assert items["type"] == "array" and items["items"] == {"type": "string"}
    # the same instance serves another domain's class, with schemas TRL accepts
    airline = Tau2Environment(domain="airline")
    assert type(airline).__name__ == "Tau2AirlineEnvironment" and hasattr(airline, "book_reservation")
    assert not hasattr(env, "book_reservation")
    get_json_schema(airline.book_reservation)


# ------------------------------------------------------------------------------------------------------------
# Reward
# ------------------------------------------------------------------------------------------------------------
def test_gold_replay_scores_one_and_agrees_with_tau2():
    tasks = _write_tasks(n_with_info=3, n_without=2)
    env = Tau2Environment(domain="retail", shaping=0.0)
    for tid in tasks:
        _play_gold(env, tid)
        assert env.get_reward() == 1.0, (tid, env.reward_info)
        assert env.reward_info["db_match"] and env.reward_info["communicate"]
        assert tau2_reference_reward(env) == 1.0
    # with shaping: + shaping * (gold fraction 1 + valid fraction) / 2 (gold actions may fail in τ²'s data)
    shaped = Tau2Environment(domain="retail", shaping=0.1)
    _play_gold(shaped, EXCHANGE_TASK)
    assert shaped.get_reward() == pytest.approx(1.1)
    assert shaped.reward_info["gold_fraction"] == 1.0 and shaped.reward_info["valid_fraction"] == 1.0


def test_doing_nothing_on_a_write_task_scores_zero():
    for shaping in (0.0, 0.1):
        env = Tau2Environment(domain="retail", shaping=shaping)
        env.reset(**_row(EXCHANGE_TASK))
        assert env.get_reward() == 0.0
        assert env.reward_info["db_match"] is False and env.reward_info["shaping_term"] == 0.0
        assert tau2_reference_reward(env) == 0.0


def test_doing_nothing_on_a_task_without_writes_passes_the_db_check():
    """What `write_only` filters out: on a task whose gold actions write nothing, the database is already the
    gold one, so doing nothing scores τ²'s 1 unless the task requires information told to the user."""
    d = _domain()
    env = Tau2Environment(domain="retail", shaping=0.0)
    read_only = [tid for tid, t in d.tasks.items() if not d.is_write_task(t)]
    assert len(read_only) == 9  # of 114 retail tasks (this data version)
    scores = {}
    for tid in read_only:
        env.reset(task_id=tid)
        scores[tid] = env.get_reward()
        assert env.reward_info["db_match"] is True
        assert scores[tid] == float(not d.tasks[tid].evaluation_criteria.communicate_info), tid
    assert sum(scores.values()) == 5


def test_perturbed_trajectories_score_zero_like_tau2():
    env = Tau2Environment(domain="retail", shaping=0.1)
    gold = _task(EXCHANGE_TASK).evaluation_criteria.actions
    exchange = dict(gold[4].arguments)
    assert gold[4].name == "exchange_delivered_order_items"
    # 1. a wrong argument: another available clicky full-size keyboard (the call succeeds, the DB differs)
    _play_gold(env, EXCHANGE_TASK, replace={4: {**exchange, "new_item_ids": ["6342039236", "7747408585"]}})
    assert "Error" not in env._calls[-1].content
    assert env.reward_info == {} and env.get_reward() == pytest.approx(0.1 * (4 / 5 + 1) / 2)
    assert env.reward_info["task_reward"] == 0.0 and tau2_reference_reward(env) == 0.0
    # 2. a missing write action
    _play_gold(env, EXCHANGE_TASK, drop={4})
    assert env.reward_info == {} and env.get_reward() == pytest.approx(0.1 * (4 / 5 + 1) / 2)
    assert tau2_reference_reward(env) == 0.0
    # 3. a failing write (unknown item id): an error string, the DB is unchanged
    _play_gold(env, EXCHANGE_TASK, replace={4: {**exchange, "new_item_ids": ["0000000000", "7747408585"]}})
    assert env._calls[-1].content.startswith("Error:")
    assert env.get_reward() == pytest.approx(0.1 * (4 / 5 + 4 / 5) / 2) and tau2_reference_reward(env) == 0.0
    # 4. the right actions, but the required information is never told to the user
    (tid,) = _write_tasks(n_with_info=1, n_without=0)
    strict = Tau2Environment(domain="retail", shaping=0.0)
    _play_gold(strict, tid, say_info=False)
    assert (
        strict.get_reward() == 0.0
        and strict.reward_info["db_match"]
        and not strict.reward_info["communicate"]
    )
    assert tau2_reference_reward(strict) == 0.0


# ------------------------------------------------------------------------------------------------------------
# Tool errors, isolation, conversation end
# ------------------------------------------------------------------------------------------------------------
def test_tool_errors_return_strings_and_never_raise():
    env = Tau2Environment(domain="retail")
    assert env.get_order_details(order_id="#W2378156").startswith("Error: the environment has not been reset")
    env.reset(**_row(EXCHANGE_TASK))
    assert env.get_order_details(order_id="#W0000000") == "Error: Order not found"
    assert env.find_user_id_by_name_zip(first_name="Yusuf").startswith("Error:")  # missing arguments
    assert env.get_order_details(order_id="#W2378156", color="red").startswith("Error:")  # unknown argument
    assert env.get_order_details(order="#W2378156").startswith("Error:")
    r = env.exchange_delivered_order_items(order_id="#W2378156", item_ids="1151293680", new_item_ids=7,
                                           payment_method_id=None)  # fmt: skip
    assert r.startswith("Error:")
    assert env.calculate(expression="__import__('os')").startswith("Error:")
    assert json.loads(env.get_order_details("#W2378156"))["order_id"] == "#W2378156"  # positional argument
    assert env.find_user_id_by_name_zip("Yusuf", "Rossi", zip="19122") == "yusuf_rossi_9620"
    assert env.send_message_to_user().startswith("Error:")
    assert env.send_message_to_user(msg="hi").startswith("Error:")
    assert env.get_reward() >= 0.0 and env.reward_info["num_tool_errors"] == 6
    # τ²'s max_errors (10; 3 here): the last failing call ends the episode abnormally (reward 0 even after the
    # gold actions)
    env = Tau2Environment(domain="retail", shaping=0.0, max_errors=3)
    env.reset(**_row(EXCHANGE_TASK))
    for _ in range(3):
        out = env.get_order_details(order_id="#W0")
    assert "conversation has ended" in out
    for action in _task(EXCHANGE_TASK).evaluation_criteria.actions:
        assert getattr(env, action.name)(**action.arguments).startswith("Error: the conversation has ended")
    assert env.send_message_to_user("hello?").startswith("Error: the conversation has ended")
    assert env.get_reward() == 0.0 and env.reward_info["termination"] == "too_many_errors"


def test_tool_latency_sleeps_per_call_and_user_turn_and_changes_nothing_else(monkeypatch):
    """`tool_latency` sleeps once per tool call (failing ones too) and per message to the user, never after
    the episode has ended; the results, the reward and its parts are those of an episode without it."""
    import trl_dta.envs.tau2.environment as environment_module

    def episode(latency):
        slept = []
        monkeypatch.setattr(environment_module.time, "sleep", slept.append)
        env = Tau2Environment(domain="retail", tool_latency=latency)
        env.reset(**_row(EXCHANGE_TASK))
        crit = _task(EXCHANGE_TASK).evaluation_criteria
        out = [getattr(env, a.name)(**a.arguments) for a in crit.actions]
        out.append(env.get_order_details(order_id="#W0000000"))  # a failing call waits too
        out.append(env.send_message_to_user("Done: " + ", ".join(crit.communicate_info)))
        out.append(env.send_message_to_user("###STOP###"))  # ends the episode
        out.append(env.get_order_details(order_id="#W2378156"))  # closed: no call, no wait
        return out, env.get_reward(), env.reward_info, slept, len(crit.actions)

    plain, reward, info, slept, gold = episode(0)
    assert slept == []
    delayed, reward_delayed, info_delayed, slept_delayed, _ = episode(0.25)
    assert (delayed, reward_delayed, info_delayed) == (plain, reward, info)
    assert info["task_reward"] == 1.0  # the gold episode
    assert slept_delayed == [0.25] * (gold + 3)  # gold calls, a failing call, two messages; not after the end
    monkeypatch.undo()
    env = Tau2Environment(domain="mock", tool_latency=0.05)  # the real sleep
    env.reset(task_id=next(iter(get_domain("mock").tasks)))
    started = time.perf_counter()
    env.send_message_to_user("hello")
    assert time.perf_counter() - started >= 0.05
    for bad, error in ((-0.1, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
                       ("0.2", TypeError), (True, TypeError)):  # fmt: skip
        with pytest.raises(error, match="tool_latency"):
            Tau2Environment(domain="mock", tool_latency=bad)


def test_domain_classes_pickle_by_reference():
    """The per-domain class is made by a cached factory, not put in a module's globals: pickle finds it by
    name through the module's __getattr__, also in a fresh process where it was never made."""
    env = Tau2Environment(domain="mock")
    assert pickle.loads(pickle.dumps(env)).__class__ is type(env)
    env.reset(task_id=next(iter(get_domain("mock").tasks)))
    assert pickle.loads(pickle.dumps(env))._task.id == env._task.id
    code = "import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); print(c.__name__, c._tau2_domain)"
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(type(env)), capture_output=True,
                         check=True, timeout=120).stdout  # fmt: skip
    assert out.split() == [b"Tau2MockEnvironment", b"mock"]
    with pytest.raises(ValueError, match="not supported"):
        Tau2Environment(domain="telecom")


def test_episodes_never_share_a_database():
    a, b = Tau2Environment(domain="retail"), Tau2Environment(domain="retail")
    a.reset(**_row(EXCHANGE_TASK))
    b.reset(**_row(EXCHANGE_TASK))
    cancel = {"order_id": "#W2378156", "item_ids": ["1151293680"], "new_item_ids": ["7706410293"],
              "payment_method_id": "credit_card_9513926"}  # fmt: skip
    assert json.loads(a.exchange_delivered_order_items(**cancel))["status"] == "exchange requested"
    assert json.loads(b.get_order_details(order_id="#W2378156"))["status"] == "delivered"
    assert json.loads(a.get_order_details(order_id="#W2378156"))["status"] == "exchange requested"
    assert a.exchange_delivered_order_items(**cancel).startswith("Error: Non-delivered")  # a's own state
    # a reset gives the same instance a fresh database (TRL reuses instances across batches)
    a.reset(**_row(EXCHANGE_TASK))
    assert json.loads(a.get_order_details(order_id="#W2378156"))["status"] == "delivered"
    # the shared read-only database is untouched
    d = _domain()
    assert d.shared.get_db_hash() == d.pristine_hashes[0]


def test_scripted_user_follows_its_scenario():
    user = ScriptedUser(_task(EXCHANGE_TASK))  # "You are Yusuf Rossi in zip code 19122." / no email
    assert user.opening.startswith("Hi! I received my order #W2378156")
    assert "19122" in user.respond("Could you tell me your zip code?")
    reply = user.respond("Please provide your email address, or your name and zip code.")
    assert "Yusuf Rossi" in reply and "19122" in reply and "not remember my email" in reply
    assert "not remember my email" in user.respond("What is your email?")
    assert "#W2378156" in user.respond("What is the order id?")
    assert user.respond(
        "I will exchange the keyboard and the thermostat. Do you confirm (yes/no)?"
    ).startswith("Yes")
    assert (
        user.respond("Done! The exchange has been completed. Is there anything else I can help with?") == STOP
    )
    assert user.respond("I am transferring you to a human agent.") == TRANSFER
    other = ScriptedUser(_task("10"), max_turns=2)  # "You are mia_garcia_4516 (mia.garcia2723@example.com)."
    assert "mia.garcia2723@example.com" in other.respond("What is your email?")
    assert "mia_garcia_4516" in other.respond("What's your user id?")
    assert other.respond("What is your email?") == STOP  # after max_turns replies


def test_user_turns_enter_through_send_message_and_the_episode_stops():
    env = Tau2Environment(domain="retail", max_user_turns=2)
    assert env.reset(**_row(EXCHANGE_TASK)) is None  # the opening is already in the prompt
    assert "19122" in env.send_message_to_user("Hello! What is your name and zip code?")
    assert env.send_message_to_user("Shall I proceed (yes/no)?").startswith("Yes")
    assert env.send_message_to_user("Anything else?") == STOP  # the 3rd message: max_user_turns reached
    assert env.get_order_details(order_id="#W2378156").startswith("Error: the conversation has ended")
    env.reset(**_row(EXCHANGE_TASK))
    assert env.send_message_to_user("Your request is complete. Anything else?") == STOP  # the user is done
    assert env.send_message_to_user("Bye").startswith("Error: the conversation has ended")
    assert env.get_reward() == 0.0 and env.reward_info["termination"] == "user_stop"
    # without a prompt in the row, reset returns the opening (TRL appends it to the last user message)
    assert env.reset(task_id=EXCHANGE_TASK).startswith("Hi! I received my order")


def test_llm_user_interface_without_network(monkeypatch):
    user = LLMUser("http://127.0.0.1:9/v1", model="m")
    replies = iter(["Hi, I want to exchange a keyboard.", "My zip code is 19122."])
    monkeypatch.setattr(user, "_complete", lambda: next(replies))
    env = Tau2Environment(domain="retail", user=user)
    assert env.reset(task_id=EXCHANGE_TASK) == "Hi, I want to exchange a keyboard."
    assert env.send_message_to_user("Your zip code?") == "My zip code is 19122."
    assert [m["role"] for m in env._user.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "<scenario>" in env._user.messages[0]["content"] and "19122" in env._user.messages[0]["content"]
    assert user.messages == []  # each environment works on its own copy


# ------------------------------------------------------------------------------------------------------------
# Inside TRL
# ------------------------------------------------------------------------------------------------------------
class _Tau2Script:
    """Scripted generation for the exchange task: turn 0 (every member) calls find_user_id_by_name_zip; then
    member 0 tells the user it is done (the user stops) and ends; member 1 calls get_order_details with an
    unknown id (env error string), then a tool that does not exist (TRL's error), then emits a malformed call
    (TRL parses it as text: the rollout ends)."""

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        tok = self._tokenizer
        response_id = tok.convert_tokens_to_ids("<tool_response>")
        seen, out = Counter(), []
        for ids in prompt_ids:
            ids = list(ids.tolist() if torch.is_tensor(ids) else ids)
            member = seen[tuple(ids)]
            seen[tuple(ids)] += 1
            turns = ids.count(response_id)
            last = tok.decode(ids[len(ids) - ids[::-1].index(response_id) :]) if turns else ""
            if turns == 0:
                body = self._call(
                    "find_user_id_by_name_zip", first_name="Yusuf", last_name="Rossi", zip="19122"
                )
            elif "###STOP###" in last:
                body = "Thank you, goodbye!"
            elif "Order not found" in last:
                body = self._call("not_a_tool")
            elif "not_a_tool" in last:
                body = '<tool_call>\n{"name": "calculate", "arguments": {"expression": \n</tool_call>'
            elif member == 0:
                body = self._call("send_message_to_user", message="I found your account. Anything else?")
            else:
                body = self._call("get_order_details", order_id="#W0000000")
            out.append(tok.encode(body, add_special_tokens=False) + [tok.eos_token_id])
        return out, None

    @staticmethod
    def _call(name, **arguments):
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_one_tree_ppo_step_with_the_environment(tmp_path):
    from trl_dta import TreePPOConfig, TreePPOTrainer
    from trl_dta.testing.grpo import make_config, tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    dataset = load_tau2_dataset(split="train", policy=False).filter(lambda r: r["task_id"] == EXCHANGE_TASK)
    trainer_cls = type("Tau2Scripted", (_Tau2Script, TreePPOTrainer), {})
    config = make_config(tmp_path, config_cls=TreePPOConfig, per_device_train_batch_size=2, num_generations=2,
                         num_iterations=1, max_steps=1, max_completion_length=512)  # fmt: skip
    trainer = trainer_cls(
        model=tiny_model(tok, max_position_embeddings=16384),
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        environment_factory=functools.partial(Tau2Environment, domain="retail"),
    )
    trainer.train()
    assert trainer.state.global_step == 1
    rewards = [env.reward_info["reward"] for env in trainer.environments]
    # shaping 0.1 * (gold fraction 1/5 + valid fraction) / 2; member 1: 1 of its 2 env tool calls failed
    assert sorted(rewards) == pytest.approx(sorted([0.1 * (1 / 5 + 1) / 2, 0.1 * (1 / 5 + 1 / 2) / 2]))
    assert {env.reward_info["termination"] for env in trainer.environments} == {"user_stop", None}
    logs = trainer.state.log_history[0]
    assert logs["rewards/Tau2RetailEnvironment/mean"] == pytest.approx(sum(rewards) / 2)
    assert logs["tools/call_frequency"] == pytest.approx((2 + 3) / 2)  # TRL counts the unknown tool too
    # TRL's failure count sees only the unknown tool: the environment answers its own errors with a string
    assert logs["tools/failure_frequency"] == pytest.approx(1 / 5)


# ------------------------------------------------------------------------------------------------------------
# Synthetic mock tasks and gold conversations (the demo's tasks and warm start)
# ------------------------------------------------------------------------------------------------------------
def test_synthetic_mock_tasks_are_scored_by_tau2():
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

    train, test = add_mock_create_tasks(6, 3, seed=1)
    assert (train, test) == add_mock_create_tasks(6, 3, seed=1)  # deterministic, adding again is a no-op
    assert len(set(train + test)) == 9 and not set(train) & set(test)
    assert add_mock_create_tasks(6, 3, seed=2) != (train, test)
    rows = load_tau2_dataset("mock", task_ids=test, policy=False)
    assert list(rows["task_id"]) == test
    title = get_domain("mock").tasks[test[0]].evaluation_criteria.actions[0].arguments["title"]
    assert f"'{title}'" in rows[0]["prompt"][-1]["content"]  # the user asks for it

    def reward(*calls):
        env = Tau2Environment("mock", shaping=0.0)
        env.reset(**rows[0])
        for name, kwargs in calls:
            getattr(env, name)(**kwargs)
        return env.get_reward()

    assert reward() == 0.0
    assert reward(("create_task", {"user_id": "user_1", "title": title})) == 1.0
    assert reward(("get_users", {}), ("create_task", {"user_id": "user_1", "title": title})) == 1.0
    assert reward(("create_task", {"user_id": "user_1", "title": title.lower()})) == 0.0
    assert reward(("create_task", {"user_id": "user_1", "title": title, "description": "x"})) == 0.0
    with pytest.raises(ValueError, match="Unknown"):
        load_tau2_dataset("mock", task_ids=["no such task"])
    with pytest.raises(ValueError, match="at most"):
        add_mock_create_tasks(10_000, 0)


def test_synthetic_mock_environment_factory_works_in_a_fresh_process():
    """A pickled `partial(synthetic_mock_environment, ...)` (what TRL's async rollout worker gets in its
    spawned process) has the synthetic tasks there; a plain mock environment there does not."""
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks, synthetic_mock_environment

    train, test = add_mock_create_tasks(4, 2, seed=5)
    factory = functools.partial(synthetic_mock_environment, 4, 2, 5, shaping=0.0, tool_latency=0.01)
    code = (
        "import pickle, sys\n"
        "factory, plain, task_id = pickle.loads(sys.stdin.buffer.read())\n"
        "try:\n"
        "    plain().reset(task_id=task_id)\n"
        "except ValueError as e:\n"
        "    print('plain:', e)\n"
        "env = factory()\n"
        "env.reset(task_id=task_id)\n"
        "print(env.create_task(user_id='user_1', title=task_id.split(':', 1)[1])[:1], env.get_reward())\n"
    )
    payload = pickle.dumps((factory, functools.partial(Tau2Environment, "mock"), test[0]))
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    lines = out.stdout.decode().splitlines()
    assert lines[0].startswith("plain: Unknown τ² mock task id") and lines[-1] == "{ 1.0"


@pytest.mark.parametrize("domain, task_id", [("mock", None), ("retail", EXCHANGE_TASK)])
def test_gold_conversation_replays_gold_actions(domain, task_id):
    from trl_dta.envs.tau2.gold import gold_conversation, tool_schemas
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

    ids = add_mock_create_tasks(1, 0, seed=3)[0] if task_id is None else [task_id]
    row = load_tau2_dataset(domain, task_ids=ids, policy=False)[0]
    env = Tau2Environment(domain)
    conversation = gold_conversation(row, env)
    messages, gold = conversation["messages"], get_domain(domain).tasks[ids[0]].evaluation_criteria.actions
    assert messages[: len(row["prompt"])] == row["prompt"] and messages[-1]["role"] == "assistant"
    calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
    assert [c["name"] for c in calls[: len(gold)]] == [a.name for a in gold]
    assert [json.loads(c["arguments"]) for c in calls[: len(gold)]] == [a.arguments for a in gold]
    results = [m for m in messages if m["role"] == "tool"]
    assert len(results) == len(calls) and not any(r["content"].startswith("Error") for r in results)
    schemas = json.loads(conversation["tools"])
    assert schemas == tool_schemas(env) and [s["function"]["name"] for s in schemas] == sorted(
        n
        for n, _ in inspect.getmembers(type(env), inspect.isfunction)
        if not n.startswith("_") and n not in ("reset", "get_reward")
    )  # fmt: skip (the tools TRL exposes, in its order)
    assert env.reward_info["task_reward"] == 1.0
