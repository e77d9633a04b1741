"""Group relative policy optimisation with verifiable rewards (data=prompts), as TRL 1.16's
GRPOTrainer computes it (`_generate_and_score_completions`, `_compute_loss`).

Each step, every rank samples objective.num_generations completions for each of its prompts with
the current policy (objective.temperature, top_p, max_new_tokens), scores them with the reward
functions (trainloop.objectives.rewards: weighted, None skipped) and normalises each completion's reward
within its group of the same prompt (objective.scale_rewards: by the group's std, the step's
global batch's, or none). The loss is the clipped policy ratio times the advantage per completion
token, plus beta x the KL to the reference (the model with its LoRA adapters disabled, or a full
fine-tune's frozen copy of the starting model, sharded like the policy), summed as
objective.loss_type says (TRL's names and definitions: trainloop.objectives.policy_gradient); the ratio
is per token or, objective.importance_sampling_level=sequence (GSPO), one per completion; and
objective.top_entropy_quantile keeps only the step's highest-entropy tokens in the policy term.

The loop hands a step's prompt micro-batches to step_batches, which returns the completion
micro-batches trained on; with objective.num_iterations = k, each generated batch is trained on
for k steps (the ratio to the log-probabilities it was sampled with then moves from 1). Each
completion draws its tokens from its own key, (trainer.seed, step, the prompt's index in the set,
which of its num_generations, the tool round): the same completions on any number of ranks and
micro-batches, and after a resume, without a state to save (generation.RowDraws). A run resumed
inside a num_iterations window trains on the window's completions, which each rank's checkpoint
holds (rank_state).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from trainloop.objectives.base import BatchLoss, Objective
from trainloop.objectives.generation import (
    complete, completion_mask, generation_config, left_padded, length_problems, row_keys, sampling, sampling_seed,
)
from trainloop.objectives.policy_gradient import (
    CLIPPED, LEVELS, LOSS_TYPES, SCALES, completion_logps, group_advantages, policy_loss, summed_loss,
)
from trainloop.objectives.reference import reference_model
from trainloop.parallel.degrees import FROZEN, GENERATION

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

log = logging.getLogger("trainloop")

SHOWN = 2  # completions (with their rewards) in each log interval's event=samples record


@dataclass
class GRPOConfig:
    # the reward functions, [module:function, ...] or [path/to/file.py:function, ...] (trainloop/objectives/rewards.py);
    # some reward column is required: a function, a reward model or an environment's get_reward
    rewards: list[str] = field(default_factory=list)
    # reward models: directories transformers loads as a sequence classifier with one label (an objective=reward
    # run's RUN_DIR/final), each a reward column named after its directory, held whole on each rank
    reward_models: list[str] = field(default_factory=list)
    # one weight per reward function, then per reward model (then, optionally, the environment's); null: each 1.0
    reward_weights: Optional[list[float]] = None
    num_generations: int = 8  # completions sampled per prompt (a group)
    temperature: float = 1.0  # sampling temperature (the log-probabilities are taken at it too)
    top_p: float = 1.0  # nucleus sampling's probability mass, in (0, 1]
    max_new_tokens: int = 128  # the longest completion; a longer one is cut (truncated)
    scale_rewards: str = "group"  # divide the advantages by the std of the group's rewards, the batch's, or none
    # as TRL 1.16 defines them: dapo (its default), grpo, dr_grpo, bnpo, luspo (the clipped ratio, each summed its own
    # way); cispo (the ratio capped at epsilon_high, detached, weighting the log-probability); sapo (a soft gate
    # around ratio 1); vespo (a gamma weight of the completion's ratio)
    loss_type: str = "dapo"
    epsilon: float = 0.2  # the clipped losses' ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: Optional[float] = None  # null: epsilon; loss_type=cispo: the cap of the ratio (TRL suggests 5.0)
    # token: a ratio per token; sequence: one per completion, the exp of its tokens' mean log-ratio (GSPO)
    importance_sampling_level: str = "token"
    # the share of the completion tokens, by entropy, that the policy term keeps (the top ones over every rank's
    # micro-batch, as TRL's): 1.0 keeps all, 0.2 the 80/20 paper's; 0 the highest-entropy token alone
    top_entropy_quantile: float = 1.0
    sapo_temperature_pos: float = 1.0  # loss_type=sapo: the gate's temperature where the advantage is positive
    sapo_temperature_neg: float = 1.05  # loss_type=sapo: the gate's temperature where the advantage is not positive
    vespo_k_pos: float = 2.0  # loss_type=vespo: the gamma weight's power k where the advantage is 0 or more
    vespo_lambda_pos: float = 3.0  # loss_type=vespo: the gamma weight's decay lambda where the advantage is 0 or more
    vespo_k_neg: float = 3.0  # loss_type=vespo: the gamma weight's power k where the advantage is negative
    vespo_lambda_neg: float = 2.0  # loss_type=vespo: the gamma weight's decay lambda where the advantage is negative
    # the weight of the KL penalty to the reference (adapter=lora: the model with its adapters disabled); 0: none,
    # and no reference is built
    beta: float = 0.0
    num_iterations: int = 1  # optimizer steps on each generated batch
    # what writes the completions: generate (Hugging Face's, a padded batch with a KV cache) or continuous
    # (transformers' continuous batching: precision=fp32, unsharded weights); generate wrote 2.6x to 2.9x the
    # tokens/s of continuous on the 2-core CPU (BENCHMARKS.md)
    generation: str = "generate"
    # tools the model may call in a rollout, [module:function, ...] or [path/to/file.py:function, ...]: plain functions
    # with type hints and a docstring, whose JSON schemas the prompts carry (trainloop/objectives/tools.py)
    tools: list[str] = field(default_factory=list)
    # module:Class or path/to/file.py:Class, as TRL's environment_factory: one instance per rollout, reset(**row)
    # before it (a text it returns is appended to the prompt's last message), its public methods the rollout's tools
    # beside objective.tools, get_reward() (if it has one) a reward column named after the class
    environment: Optional[str] = None
    max_tool_calls: Optional[int] = None  # rounds of tool calls in a rollout; null: as many as max_new_tokens holds
    tool_timeout_s: float = 10.0  # a tool call running longer is answered with an error (and left to finish alone)


def generation_problems(cfg) -> list[str]:
    """objective.generation's: continuous batching keeps its cache in the weights' dtype (no autocast over
    fp32 weights) and runs each rank on its own schedule (no weights gathered in every forward)."""
    from trainloop.objectives.generation import ENGINES
    from trainloop.parallel import forwards_together

    o = cfg.objective
    if o.generation not in ENGINES:
        return [f"objective.generation={o.generation} is not one of: {', '.join(ENGINES)}"]
    if o.generation != "continuous":
        return []
    problems = []
    if cfg.precision.name != "fp32":
        problems.append(f"objective.generation=continuous keeps its KV cache in the weights' dtype, and "
                        f"precision={cfg.precision.name} computes in another: set precision=fp32, or "
                        "objective.generation=generate")
    if sharded := forwards_together(cfg):
        problems.append(f"objective.generation=continuous runs each process on its own schedule, and {sharded} "
                        "gathers the weights in every forward of every rank together: set "
                        "objective.generation=generate")
    return problems


def shown(rollout: dict, prompt_field: str, names: list[str], rewards) -> list[dict]:
    """The first SHOWN completions of a rollout as event=samples shows them, with their rewards (None where a
    function did not apply). A conversation (a chat prompt, a rollout with tool calls) is a transcript, every
    turn a line: the calls, the tools' replies and the answer (`conversation`: the log prints it as a block)."""
    from trainloop.objectives.rewards import transcript

    out = []
    for i, (row, text) in enumerate(list(zip(rollout["rows"], rollout["texts"]))[:SHOWN]):
        prompt = row[prompt_field]
        chat = not isinstance(prompt, str)
        if chat:
            text = rollout["transcripts"][i] if "transcripts" in rollout else transcript([{"role": "assistant",
                                                                                              "content": text}])
        out.append({"prompt": transcript(prompt) if chat else prompt, "text": text,
                    "rewards": {n: None if v != v else float(v) for n, v in zip(names, rewards[i].tolist())},
                    **({"conversation": True} if chat else {})})
    return out


class GRPO(Objective):
    name = "grpo"
    needs = (GENERATION, FROZEN)  # the reference's only with objective.beta > 0
    pretrained_lr = (1e-06, "GRPOConfig")
    prompts = True
    headline = ("reward", "reward_std", "kl", "unscored")
    keys = GRPOConfig
    # the ratio to the policy that generated is 1 on the one update of a generated batch: nothing to clip;
    # cispo caps the ratio at epsilon_high (null: epsilon) whatever it is
    read_when = {
        "objective.epsilon": (lambda c: c.objective.loss_type in CLIPPED and c.objective.num_iterations > 1
                              or c.objective.loss_type == "cispo" and c.objective.epsilon_high is None,
                              f"objective.loss_type in {'/'.join(CLIPPED)} with objective.num_iterations > 1, or "
                              "loss_type=cispo with epsilon_high null"),
        "objective.epsilon_high": (lambda c: c.objective.loss_type in CLIPPED and c.objective.num_iterations > 1
                                   or c.objective.loss_type == "cispo",
                                   f"objective.loss_type in {'/'.join(CLIPPED)} with objective.num_iterations > 1, "
                                   "or loss_type=cispo"),
        # at ratio 1 a completion's one ratio has its tokens' gradient: read where the ratio moves, and by the
        # KL's ratio factor; vespo weighs by the completion's summed log-ratio, whatever the level
        "objective.importance_sampling_level": (
            lambda c: c.objective.num_iterations > 1 and c.objective.loss_type != "vespo" or c.objective.beta != 0,
            "objective.num_iterations > 1 (loss_type other than vespo), or objective.beta > 0"),
        **{f"objective.sapo_{key}": (lambda c: c.objective.loss_type == "sapo", "objective.loss_type=sapo")
           for key in ("temperature_pos", "temperature_neg")},
        **{f"objective.vespo_{key}": (lambda c: c.objective.loss_type == "vespo", "objective.loss_type=vespo")
           for key in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")},
        **{f"objective.{key}": (lambda c: bool(c.objective.tools) or c.objective.environment is not None,
                                "objective.tools names some, or objective.environment is set")
           for key in ("max_tool_calls", "tool_timeout_s")},
    }

    @classmethod
    def needs_in(cls, cfg) -> tuple[str, ...]:
        return cls.needs if cfg.objective.beta > 0 else (GENERATION,)

    def __init__(self, cfg, device):
        import torch

        from trainloop.data.tokenizer import build_tokenizer, pad_id
        from trainloop.objectives.rewards import Rewards

        o = self.cfg = cfg.objective
        self.said_cut = self.said_failing = False  # the warnings of most completions cut, of every tool call failing: once a run
        self.environments = None  # objective.environment's instances, one per rollout of a step
        if o.environment is not None:
            from trainloop.objectives.tools import Environments

            self.environments = Environments(o.environment, o.tools)
        rewarded = self.environments is not None and self.environments.rewarded
        self.rewards = Rewards(o.rewards, o.reward_weights,
                               (self.environments.name, self.environments.reward) if rewarded else None,
                               o.reward_models, device)
        self.tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)  # decodes the completions
        self.eos, self.pad = self.tokenizer.eos_token_id, pad_id(self.tokenizer)
        # sampling as configured here, whatever a pretrained model's generation_config.json says
        # (a repetition penalty there would sample from another distribution than the loss's), as TRL does
        # with a KV cache whatever the model's config says (the tiny models' say use_cache=False, for training):
        # without, every new token recomputes the whole prefix (7.3x slower on bench_grpo's model)
        self.sampling = generation_config(do_sample=True, temperature=o.temperature, top_p=o.top_p, top_k=0,
                                          max_new_tokens=o.max_new_tokens, pad_token_id=self.pad, eos_token_id=self.eos,
                                          use_cache=True)
        self.greedy = generation_config(do_sample=False, max_new_tokens=o.max_new_tokens, pad_token_id=self.pad,
                                        eos_token_id=self.eos, use_cache=True)
        self.epsilon_high = o.epsilon if o.epsilon_high is None else o.epsilon_high
        # {name: function} of objective.tools; whether a rollout has turns (tools, or an environment's methods); the
        # template the tools' replies are rendered with
        self.tools, self.multi_turn = {}, bool(o.tools) or bool(self.environments and self.environments.methods)
        if o.tools:
            from trainloop.objectives.tools import load_tools

            self.tools = load_tools(o.tools)
        if self.multi_turn:
            from trainloop.data.chat_template import chat_template

            self.template = chat_template(cfg.data, self.tokenizer)
        if self.environments is not None:  # a prompt that reset() adds to is rendered again, as the data's were
            from trainloop.data.formats.prompts import Prompts

            from trainloop.objectives.tools import tool_schemas

            # the tools and the environment already loaded above, not loaded again
            self.render = Prompts().prompt_tokens(cfg.data, self.tokenizer, tool_schemas(self.tools, self.environments))
            self.seq_len = cfg.data.seq_len
        self.adapted, self.frozen = cfg.adapter.name != "none", None  # frozen: a full fine-tune's reference
        self.copies = self.copies_model(cfg)
        self.seed, self.prompt_field = cfg.trainer.seed, cfg.data.prompt_field
        self.device = torch.device(device)
        self.generated: list[dict] | None = None  # the batches being trained on (num_iterations)
        self.sums = self.zero_sums()
        self.longest = 0  # the longest completion since the last train line, on this rank
        self.generating_s = 0.0  # seconds spent generating since the last train line, on this rank
        self.shown: list[dict] = []

    def zero_sums(self):
        import torch

        # completions, scored ones, reward sum and squares; per function: sum, count; length sum,
        # truncated, tool calls, failed ones; trained tokens, the units of the clip ratio (or of vespo's
        # weight: tokens, or completions where each has one value) and their sum, KL sum
        return torch.zeros(4 + 2 * len(self.rewards.names) + 8, dtype=torch.float64, device=self.device)

    @staticmethod
    def problems(cfg) -> list[str]:
        from trainloop.objectives.rewards import reward_problems

        o, problems = cfg.objective, []
        environment = None
        if o.environment is not None:
            from trainloop.errors import ConfigError
            from trainloop.objectives.tools import Environments

            try:
                made = Environments(o.environment, o.tools)
                environment = made.name if made.rewarded else None
            except ConfigError as err:
                problems.append(str(err))
        problems += reward_problems(o.rewards, o.reward_weights, environment, o.reward_models)
        if o.loss_type not in LOSS_TYPES:
            problems.append(f"objective.loss_type={o.loss_type} is not one of objective=grpo's: {', '.join(LOSS_TYPES)}")
        if o.importance_sampling_level not in LEVELS:
            problems.append(f"objective.importance_sampling_level={o.importance_sampling_level} is not one of: "
                            f"{', '.join(LEVELS)}")
        if not 0 <= o.top_entropy_quantile <= 1:
            problems.append(f"objective.top_entropy_quantile={o.top_entropy_quantile} must be in [0, 1] "
                            "(1: every token)")
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(o, key) > 0:
                problems.append(f"objective.{key}={getattr(o, key)} must be greater than 0")
        if o.scale_rewards not in SCALES:
            problems.append(f"objective.scale_rewards={o.scale_rewards} is not one of: {', '.join(SCALES)}")
        if o.num_generations < 2:
            problems.append(f"objective.num_generations={o.num_generations}: a group needs at least 2 completions "
                            "to compare (its advantages are relative to their mean)")
        for key in ("temperature", "max_new_tokens", "num_iterations"):
            if not getattr(o, key) > 0:
                problems.append(f"objective.{key}={getattr(o, key)} must be greater than 0")
        if not 0 < o.top_p <= 1:
            problems.append(f"objective.top_p={o.top_p} must be in (0, 1]")
        if not o.epsilon >= 0 or (o.epsilon_high is not None and not o.epsilon_high >= 0):
            problems.append(f"objective.epsilon={o.epsilon} and epsilon_high={o.epsilon_high} must be 0 or more")
        if o.beta < 0:
            problems.append(f"objective.beta={o.beta} must be 0 (no KL penalty) or more")
        problems += length_problems(cfg)
        problems += generation_problems(cfg)
        if o.tools:
            from trainloop.objectives.tools import tool_problems

            problems += tool_problems(o.tools)
        if o.tools or o.environment is not None:
            if o.max_tool_calls is not None and o.max_tool_calls < 1:
                problems.append(f"objective.max_tool_calls={o.max_tool_calls} must be 1 or more (null: no limit but "
                                "objective.max_new_tokens); objective.tools=[] calls none")
            if not o.tool_timeout_s > 0:
                problems.append(f"objective.tool_timeout_s={o.tool_timeout_s} must be greater than 0")
        if cfg.trainer.auto_batch_size:
            problems.append("objective=grpo does not search a batch size yet: set trainer.auto_batch_size=false")
        if cfg.compile.backend != "none":
            problems.append("objective=grpo generates with the model, which a compiled one would recompile for each "
                            "length: set compile=none in this slice")
        return problems

    # --- the step: prompts in, completions out ---------------------------------------------------

    def draws(self, step: int) -> bool:
        """A new batch of prompts every num_iterations steps. A run resumed inside such a window trains
        on the window's completions, which the checkpoint holds (rank_state); one resumed at another
        world size has none for its ranks: it draws anew, and says so."""
        if step % self.cfg.num_iterations == 0:
            return True
        if self.generated is None:
            log.warning("resumed at step %d, inside a window of objective.num_iterations=%d steps whose generated "
                        "batch the checkpoint does not hold for this rank: generating a new one", step,
                        self.cfg.num_iterations)
            return True
        return False

    def rank_state(self) -> dict | None:
        """The completion micro-batches a num_iterations window trains on (with their advantages and
        log-probabilities from before its first update): a resume inside it goes on with them."""
        return None if self.generated is None else {"generated": self.generated}

    def load_rank_state(self, state: dict) -> None:
        self.generated = state["generated"]

    def step_batches(self, strategy, model, group: list[dict] | None, step: int) -> list[dict]:
        """The completion micro-batches of a step: generated for the prompts of `group`, or, inside a
        num_iterations window (group None), the ones generated at its start."""
        if group is None:
            return self.generated
        import torch

        started = time.perf_counter()
        if self.environments is not None:
            self.environments.start()
        rollouts = [self.generate(strategy, model, batch, step, sampling_seed(self.seed, step, strategy.dp_rank, i))
                    for i, batch in enumerate(group)]
        self.generating_s += time.perf_counter() - started
        rewards = self.agreed_scores(strategy, rollouts)
        weights = torch.tensor(self.rewards.weights, device=rewards.device)
        advantages, summed = group_advantages(rewards, weights, self.cfg.num_generations, self.cfg.scale_rewards,
                                              lambda x: self.batch_moments(strategy, x))
        self.require_scored(strategy, summed, step)
        self.record(rollouts, rewards, summed)
        batches, start = [], 0
        for rollout in rollouts:
            n = rollout["completion_mask"].shape[0]
            batch = {key: rollout[key] for key in ("input_ids", "attention_mask", "position_ids", "completion_mask")}
            batch["advantages"] = advantages[start:start + n]
            start += n
            batches.append(self.with_logps(strategy, model, batch))
        if self.cfg.num_iterations > 1:  # trained on again by the window's next steps
            self.generated = batches
        return batches

    def generate(self, strategy, model, batch: dict, step: int, seed: int) -> dict:
        """num_generations completions of each prompt of the batch, each drawn from its own key (the
        module's docstring; `seed`: the continuous engine's generator), every rank taking part in every
        forward (trainloop.observe.samples says why)."""
        import torch

        n = self.cfg.num_generations
        keep = batch["prompt_mask"].any(0)  # the columns where some prompt has a token: the rest is padding
        prompt_ids = batch["prompt_ids"][:, keep].repeat_interleave(n, 0)
        prompt_mask = batch["prompt_mask"][:, keep].repeat_interleave(n, 0)
        index = batch["index"]
        keys = row_keys(self.seed, step, index.repeat_interleave(n), torch.arange(n, device=index.device).repeat(len(index)))
        rows = [json.loads(r) for r in batch["row"] for _ in range(n)]
        prompt_ids, prompt_mask, environments = self.reset(strategy, rows, prompt_ids, prompt_mask)
        with sampling(strategy, model, seed) as module:
            out = complete(module, prompt_ids, prompt_mask, self.sampling, self.cfg.generation,
                           synced_gpus=self.synced(strategy), keys=keys)
            if self.multi_turn:
                return self.tool_rollout(strategy, module, prompt_ids, prompt_mask, out, self.sampling, rows,
                                         environments, keys)
        completion_ids = out[:, prompt_ids.shape[1]:]
        mask = completion_mask(completion_ids, self.eos)
        attention = torch.cat([prompt_mask, mask], 1)
        return {"input_ids": torch.cat([prompt_ids, completion_ids], 1), "attention_mask": attention,
                "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "completion_mask": mask, "rows": rows,
                "truncated": ~(completion_ids == self.eos).any(1), "environments": environments}

    def reset(self, strategy, rows: list[dict], prompt_ids, prompt_mask):
        """With objective.environment: an instance for each rollout, reset with its row (reset(**row), as
        TRL calls it); a text it returns is appended to the row's last message (or text prompt), which
        is rendered again (the rollout's row then holds that prompt, as the reward functions see it).
        The prompts, left-padded to their longest, and the instances (None without an environment).
        A reset that raises, returns other than text or None, or makes a prompt longer than data.seq_len
        stops every rank together, the one it happened on naming it and the row."""
        if self.environments is None:
            return prompt_ids, prompt_mask, None
        from trainloop.errors import ConfigError

        instances = self.environments.draw(len(rows))
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        where, error = f"objective.environment={self.environments.spec}", None
        for i, (row, instance) in enumerate(zip(rows, instances)):
            try:
                observation = instance.reset(**row)
            except Exception as err:  # noqa: BLE001 - the user's code: name it and the row, in one line
                error = ConfigError(f"{where}: reset raised {type(err).__name__}: {err} (on the row "
                                    f"{json.dumps(row, default=str)[:80]})")
                break
            if observation is None:
                continue
            if not isinstance(observation, str):
                error = ConfigError(f"{where}: reset returned {type(observation).__name__}; return text (appended to "
                                    "the prompt's last message) or None")
                break
            prompt = row[self.prompt_field]
            row[self.prompt_field] = prompt + observation if isinstance(prompt, str) else \
                prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
            prompts[i] = self.render(row[self.prompt_field])
            if len(prompts[i]) > self.seq_len:
                error = ConfigError(f"{where}: reset's text makes a prompt of {len(prompts[i])} tokens, longer than "
                                    f"data.seq_len={self.seq_len}: raise data.seq_len")
                break
        self.agree_failed(strategy, [error] if error else [], "objective.environment's reset")
        return (*left_padded(prompts, self.pad, prompt_ids), instances)

    def tool_rollout(self, strategy, module, prompt_ids, prompt_mask, out, settings, rows: list[dict],
                     environments: list | None = None, keys: torch.Tensor | None = None) -> dict:
        """The rollouts with their tool calls answered and the model asked again (trainloop.objectives.tools),
        from the first turns in `out`: completion_mask is 1 on the model's tokens only (the loss's and the
        advantage's), the attention mask on every token; the completions as messages, for the rewards.
        Each rollout calls objective.tools and its own environment's methods."""
        import torch

        from trainloop.objectives.tools import take_turns

        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        first = [self.first_turn(row) for row in out[:, prompt_ids.shape[1]:].tolist()]

        rounds = 0

        def generate(which: list[int], rows: list[list[int]], room: list[int]) -> list[list[int]]:
            nonlocal rounds
            rounds += 1  # a row's draws in round r are keyed by r: the same in any batch
            stand_in = not rows  # every rank generates together: one with nothing left takes a token of its first
            which, rows, room = ([0], prompts[:1], [1]) if stand_in else (which, rows, room)
            ids, mask = left_padded(rows, self.pad, prompt_ids)
            width = ids.shape[1]
            limited = copy.deepcopy(settings)
            limited.max_new_tokens = max(room)
            turn = complete(module, ids, mask, limited, self.cfg.generation, synced_gpus=self.synced(strategy),
                            keys=None if keys is None else row_keys(keys[which], rounds))[:, width:].tolist()
            return [] if stand_in else [self.first_turn(t)[:r] for t, r in zip(turn, room)]

        def agree(going: int) -> bool:
            return bool(strategy.sum_over_all(torch.tensor([float(going)], device=strategy.device)).item())

        functions = [{**self.tools, **self.environments.tools(e)} for e in environments] if environments \
            else [self.tools] * len(prompts)
        turns = take_turns(prompts, first, generate, agree, self.tokenizer, self.template, functions,
                           self.cfg.max_tool_calls, self.cfg.tool_timeout_s, self.cfg.max_new_tokens)
        width = max(len(t.ids) for t in turns)
        completion = torch.full((len(turns), width), self.pad, dtype=prompt_ids.dtype, device=prompt_ids.device)
        present, trained = torch.zeros_like(completion), torch.zeros_like(completion)
        for i, t in enumerate(turns):
            completion[i, :len(t.ids)] = torch.tensor(t.ids)
            present[i, :len(t.ids)], trained[i, :len(t.ids)] = 1, torch.tensor(t.trained)
        attention = torch.cat([prompt_mask, present], 1)
        return {"input_ids": torch.cat([prompt_ids, completion], 1), "attention_mask": attention,
                "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "completion_mask": trained, "rows": rows,
                "truncated": torch.tensor([t.ended or not t.ids or t.ids[-1] != self.eos for t in turns],
                                          device=completion.device),
                "messages": [t.messages for t in turns], "environments": environments,
                "tool_calls": torch.tensor([[t.calls, t.failed] for t in turns], dtype=torch.float64).sum(0)}

    def first_turn(self, ids: list[int]) -> list[int]:
        """A generated row's tokens up to and with its first end-of-text (the padding after it cut)."""
        return ids[:ids.index(self.eos) + 1] if self.eos in ids else ids

    def synced(self, strategy) -> bool:
        """generate's synced_gpus: every rank takes part in every forward (sharded weights are gathered in
        each); continuous batching runs each rank alone (refused where weights are sharded)."""
        return strategy.world_size > 1 and self.cfg.generation == "generate"

    def score(self, rollout: dict):
        """[completions, functions] rewards (NaN for None), or the ConfigError a function raised."""
        import torch

        from trainloop.errors import ConfigError

        rows, mask = rollout["rows"], rollout["completion_mask"]
        ids = rollout["input_ids"][:, -mask.shape[1]:]
        prompts = [row[self.prompt_field] for row in rows]
        if "messages" in rollout:  # with tools: the model's turns and the tools' replies, as TRL passes them
            from trainloop.objectives.rewards import text_of, transcript

            completions = rollout["messages"]
            texts = [text_of(m) for m in completions]
            rollout["transcripts"] = [transcript(m) for m in completions]
        else:
            texts = [self.tokenizer.decode(ids[i][mask[i].bool()], skip_special_tokens=True) for i in range(len(rows))]
            chat = not isinstance(prompts[0], str)
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        keys = dict.fromkeys(key for row in rows for key in row if key != self.prompt_field)
        columns = {key: [row.get(key) for row in rows] for key in keys}
        columns["completion_ids"] = [ids[i][mask[i].bool()].tolist() for i in range(len(rows))]
        if rollout.get("environments") is not None:  # each completion's instance, as TRL passes them
            columns["environments"] = rollout["environments"]
        rollout["texts"] = texts
        try:
            values = self.rewards.score(prompts, completions, columns)
        except ConfigError as err:
            return err
        return torch.tensor(values, dtype=torch.float32, device=mask.device).T

    def agreed_scores(self, strategy, rollouts: list[dict]) -> torch.Tensor:
        """The rollouts' rewards [completions, functions]; if a reward function failed on any rank,
        every rank stops here together (no rank is left waiting in a collective), the one it
        failed on naming it and the row."""
        import torch

        scores = [self.score(r) for r in rollouts]
        self.agree_failed(strategy, [s for s in scores if isinstance(s, Exception)], "a reward function")
        return torch.cat(scores)

    @staticmethod
    def agree_failed(strategy, errors: list[Exception], what: str) -> None:
        """Every rank stops together where `what` failed on any (no rank is left waiting in a collective):
        the one it failed on raises its error, the others say where it is."""
        import torch

        from trainloop.errors import ConfigError

        if strategy.sum_over_all(torch.tensor([float(len(errors))], device=strategy.device)).item():
            raise errors[0] if errors else ConfigError(f"{what} failed on another rank: its message is in that "
                                                       "rank's output")

    def require_scored(self, strategy, summed: torch.Tensor, step: int) -> None:
        """Stop (every rank) when no function scored any completion of the step: every advantage
        would be 0, a step that trains nothing while the run looks healthy."""
        import torch

        counts = torch.stack([(~torch.isnan(summed)).sum(), torch.tensor(len(summed), device=summed.device)])
        scored, completions = strategy.reduce_sum(counts.to(strategy.device)).tolist()
        if not scored:
            raise self.nothing_scored(f"the {completions} completions of step {step + 1}")

    def nothing_scored(self, what: str):
        """The error of a step (or an evaluation) whose completions no function scored."""
        from trainloop.errors import ConfigError

        return ConfigError(f"no reward function scored any of {what}: {', '.join(self.rewards.specs)} returned None "
                           "for each; give a number where a function applies (does each row hold the columns it reads?)")

    def batch_moments(self, strategy, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and std (NaN skipped, Bessel's correction) of every rank's rewards of the step, in two passes."""
        import torch

        scored = ~torch.isnan(rewards)
        first = strategy.reduce_sum(torch.stack([rewards[scored].double().sum(), scored.sum().double()]))
        mean = first[0] / first[1]
        second = strategy.reduce_sum(((rewards[scored].double() - mean) ** 2).sum().view(1))
        std = (second[0] / (first[1] - 1)).sqrt() if first[1] > 1 else torch.tensor(torch.nan, device=rewards.device)
        return mean.float(), std.float()

    def with_logps(self, strategy, model, batch: dict) -> dict:
        """The batch with the log-probabilities it needs from before any update, through the layout's forward
        (Strategy.computed): the sampling policy's (num_iterations > 1) and the reference's (beta > 0)."""
        import torch

        def logps(forward) -> torch.Tensor:
            return completion_logps(forward, batch, self.cfg.temperature)

        with torch.no_grad():
            if self.cfg.num_iterations > 1:
                batch["old_logps"] = strategy.computed(self, model, batch, logps)
            if self.cfg.beta != 0.0 and self.frozen is not None:  # a full fine-tune's frozen copy
                batch["ref_logps"] = strategy.computed(self, self.frozen, batch, logps)
            elif self.cfg.beta != 0.0:  # the policy with its adapters disabled
                reference = reference_model(model)
                with reference.disable_adapter():
                    batch["ref_logps"] = strategy.computed(self, reference, batch, logps)
        return batch

    @staticmethod
    def memory_lines(plan, cfg) -> None:
        """With beta > 0, a full fine-tune's reference copy (an adapter's is the policy without it); each
        reward model, whole on each rank in fp32 (its weights' sizes read from its safetensors headers)."""
        from trainloop.objectives.reference import plan_copy
        from trainloop.objectives.rewards import model_name, saved_numel
        from trainloop.parallel.memory import Line

        if cfg.objective.beta != 0.0 and cfg.adapter.name == "none":
            plan_copy(plan, "objective=grpo with objective.beta > 0")
        for directory in cfg.objective.reward_models:
            plan.lines.append(Line(f"reward model {model_name(directory)}", 4 * saved_numel(directory), "gpu",
                                   note="objective.reward_models: whole on each rank, fp32, no gradients"))

    @staticmethod
    def prompt_tools(cfg) -> list[dict] | None:
        """The JSON schemas of objective.tools, then of objective.environment's methods, which the prompts'
        chat template renders (as TRL renders its tools and an environment's)."""
        from trainloop.objectives.tools import Environments, load_tools, tool_schemas

        o = cfg.objective
        environments = Environments(o.environment, o.tools) if o.environment is not None else None
        return tool_schemas(load_tools(o.tools), environments)

    @classmethod
    def copies_model(cls, cfg) -> bool:
        return cfg.objective.beta != 0.0 and cfg.adapter.name == "none"

    def frozen_copy(self, model):
        """With beta > 0, a full fine-tune's reference: the model as built, frozen (an adapter's
        reference is the policy with its adapters disabled; beta 0 needs none)."""
        if not self.copies:
            return None
        import copy

        return copy.deepcopy(model).requires_grad_(False)

    def start(self, strategy, model, frozen, train_set, valid_set, run_dir) -> None:
        self.frozen = frozen  # placed and sharded like the policy by the strategy (prepare_frozen)
        self.strategy = strategy  # eval_sums generates and scores on every rank together
        if frozen is not None:
            log.info("objective=grpo: the KL's reference is a frozen copy of the starting model, %s",
                     strategy.holds_frozen(frozen))

    def record(self, rollouts: list[dict], rewards: torch.Tensor, summed: torch.Tensor) -> None:
        """The step's completions into the window's sums, and a few shown with their rewards."""
        import torch

        mask = torch.cat([r["completion_mask"].sum(1) for r in rollouts]).double()
        truncated = torch.cat([r["truncated"] for r in rollouts]).double()
        scored = ~torch.isnan(summed)
        per_function = [torch.stack([torch.nansum(rewards[:, f].double()), (~torch.isnan(rewards[:, f])).sum().double()])
                        for f in range(rewards.shape[1])]
        calls = sum((r["tool_calls"] for r in rollouts if "tool_calls" in r), torch.zeros(2, dtype=torch.float64))
        values = torch.stack([torch.tensor(float(len(summed)), dtype=torch.float64, device=summed.device),
                              scored.sum().double(), summed[scored].double().sum(), (summed[scored].double() ** 2).sum(),
                              *torch.cat(per_function), mask.sum(), truncated.sum(), *calls.to(summed.device)])
        self.sums[:len(values)] += values.to(self.sums.device)
        self.longest = max(self.longest, int(mask.max().item()))
        self.shown = shown(rollouts[0], self.prompt_field, self.rewards.names, rewards)

    # --- the loss ---------------------------------------------------------------------------------

    def count(self, batch: dict) -> torch.Tensor:
        """The units summed_loss sums over, which the step divides by once (over every micro-batch and rank)."""
        import torch

        mask = batch["completion_mask"]
        if self.cfg.loss_type in ("dapo", "cispo", "vespo"):
            return mask.sum()
        return torch.tensor(1 if self.cfg.loss_type == "bnpo" else mask.shape[0], device=mask.device)

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        import torch

        o, mask = self.cfg, batch["completion_mask"]
        if o.top_entropy_quantile < 1:
            logps, entropies = completion_logps(model, batch, o.temperature, entropy=True)
            kept = self.high_entropy(entropies, mask)
        else:
            logps, kept = completion_logps(model, batch, o.temperature), None
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        per_token, parts = policy_loss(logps, old, batch["advantages"], mask, o, self.epsilon_high,
                                       batch.get("ref_logps"), kept)
        # the units of the clip ratio or vespo's mean weight: tokens, or completions where there is one value each
        tokens, zero = mask.sum().double(), mask.new_zeros((), dtype=torch.float64)
        per_unit = parts.get("clipped", parts.get("phi"))
        if per_unit is None:  # sapo: neither
            units, counted = zero, zero
        elif per_unit.shape[1] == 1:
            units, counted = mask.new_tensor(mask.shape[0]).double(), per_unit.sum().double()
        else:
            units, counted = tokens, (per_unit * mask).sum().double()
        kl = (parts["kl"] * mask).sum().double() if "kl" in parts else zero
        self.sums[-4:] += torch.stack([tokens, units, counted, kl]).to(self.sums.device)
        return BatchLoss(summed_loss(per_token, mask, o.loss_type, o.max_new_tokens))

    def high_entropy(self, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """TRL's entropy mask (get_high_entropy_mask): the completion tokens whose entropy is at least the
        (1 - top_entropy_quantile) quantile of every data-parallel rank's completion tokens in this
        micro-batch, as 1.0 (0.0 elsewhere)."""
        import torch

        strategy, local = self.strategy, entropies[mask.bool()]
        counts = torch.zeros(strategy.dp_size, device=local.device)
        counts[strategy.dp_rank] = local.numel()
        counts = strategy.reduce_sum(counts).long().tolist()
        table = torch.zeros(strategy.dp_size, max(counts), device=local.device)
        table[strategy.dp_rank, :local.numel()] = local
        table = strategy.reduce_sum(table)
        every = torch.cat([table[r, :n] for r, n in enumerate(counts)])
        if not every.numel():
            return torch.zeros_like(entropies)
        threshold = torch.quantile(every, 1 - self.cfg.top_entropy_quantile)
        return ((entropies * mask >= threshold) & mask.bool()).float()

    def window(self, strategy) -> dict:
        """The train line's values since the last one, over every rank."""
        import torch

        # the rollouts' sums are every rank's; the loss's own four (batch_loss) the ranks' that take the loss
        total = torch.cat([strategy.reduce_sum(self.sums[:-4]), strategy.reduce_computed(self.sums[-4:])]).tolist()
        ranks = torch.zeros(strategy.dp_size, 2, device=strategy.device, dtype=torch.float64)  # maxima, by a sum
        ranks[strategy.dp_rank] = torch.tensor([self.longest, self.generating_s], dtype=torch.float64)
        longest, generating_s = strategy.reduce_sum(ranks).max(0).values.tolist()
        self.sums, self.longest, self.generating_s = self.zero_sums(), 0, 0.0
        completions, scored, reward, squares = total[:4]
        lengths, truncated, calls, failed, tokens, units, counted, kl = total[-8:]
        values = {}
        if completions:  # none inside a num_iterations window: its steps train on earlier completions
            values["unscored"] = int(completions - scored)  # no function applied: advantage 0
            if scored:  # a reward not computed is left out, never 0.0
                values["reward"] = reward / scored
            if scored > 1:
                values["reward_std"] = (max(squares - reward ** 2 / scored, 0.0) / (scored - 1)) ** 0.5
            for f, name in enumerate(self.rewards.names):  # over the completions it applied to (not None)
                if total[5 + 2 * f]:
                    values[f"rewards/{name}"] = total[4 + 2 * f] / total[5 + 2 * f]
            values.update({"completion_length": lengths / completions, "completion_length_max": longest,
                           "truncated_share": truncated / completions, "generation_s": generating_s,
                           "generated_tokens_per_s": lengths / max(generating_s, 1e-9)})
            if self.multi_turn:  # TRL's tools/call_frequency and tools/failure_frequency
                values.update({"tool_calls_per_completion": calls / completions,
                               "tool_failure_share": failed / max(calls, 1)})
        if self.cfg.loss_type in (*CLIPPED, "cispo"):  # TRL's clip_ratio/region_mean, cispo's cispo_clip_ratio
            values["clip_ratio"] = counted / max(units, 1)
        elif self.cfg.loss_type == "vespo":  # TRL's vespo/phi_seq_mean
            values["vespo_phi"] = counted / max(units, 1)
        if self.cfg.beta != 0.0:
            values["kl"] = kl / max(tokens, 1)
        if completions and truncated > completions / 2 and not self.said_cut and strategy.accelerator.is_main_process:
            self.said_cut = True
            turns = ", the model's turns and the tools' replies together" if self.multi_turn else ""
            log.warning("objective=grpo: %d of %d completions since the last line were cut at objective.max_new_tokens="
                        "%d%s: their rewards score unfinished answers; raise objective.max_new_tokens (said once)",
                        truncated, completions, self.cfg.max_new_tokens, turns)
        if calls and failed == calls and not self.said_failing and strategy.accelerator.is_main_process:
            self.said_failing = True
            log.warning("objective=grpo: every one of the %d tool calls since the last line failed (answered with "
                        "{'error': ...}: a tool that raised, no such tool, other arguments or past "
                        "objective.tool_timeout_s): see the replies in the samples, and check objective.tools and "
                        "objective.environment (said once)", calls)
        return values

    def examples(self) -> list[dict]:
        """A few of the last step's completions on this rank, with their rewards (event=samples)."""
        shown, self.shown = self.shown, []
        return shown

    # --- evaluation: greedy completions of the validation prompts ----------------------------------

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        """The summed reward of one greedy completion per prompt of the batch, and the prompts scored
        (evaluate() runs it on every rank: the generation and the scores' agreement are collective)."""
        import torch

        strategy = self.strategy
        keep = batch["prompt_mask"].any(0)
        ids, mask = batch["prompt_ids"][:, keep], batch["prompt_mask"][:, keep]
        rows = [json.loads(r) for r in batch["row"]]
        if self.environments is not None:
            self.environments.start()
        ids, mask, environments = self.reset(strategy, rows, ids, mask)
        with strategy.generator(model) as module:
            out = complete(module, ids, mask, self.greedy, self.cfg.generation, synced_gpus=self.synced(strategy))
            if self.multi_turn:
                rollout = self.tool_rollout(strategy, module, ids, mask, out, self.greedy, rows, environments)
            else:
                completion_ids = out[:, ids.shape[1]:]
                rollout = {"input_ids": torch.cat([ids, completion_ids], 1), "rows": rows,
                           "completion_mask": completion_mask(completion_ids, self.eos), "environments": environments}
        scores = self.agreed_scores(strategy, [rollout]).cpu()
        summed = (scores * torch.tensor(self.rewards.weights)[None]).nansum(1)
        summed[torch.isnan(scores).all(1)] = torch.nan
        scored = ~torch.isnan(summed)
        return torch.stack([summed[scored].double().sum(), scored.sum().double()]).to(strategy.device)

    def eval_values(self, total: torch.Tensor) -> dict:
        """The mean reward of one greedy completion per validation prompt: eval_reward, and eval_loss =
        -eval_reward (lower is better, as for every objective's eval_loss)."""
        if not total[1]:  # a mean of nothing is no reward of 0.0
            raise self.nothing_scored("the greedy completions of the validation prompts")
        reward = (total[0] / total[1]).item()
        return {"eval_loss": -reward, "eval_reward": reward}
